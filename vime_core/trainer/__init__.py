"""The megatron-core trainer: one `Trainer` per rank (a Ray actor, see cluster.py), driven by `TrainerGroup`.

- `rank`: the actor: process group, parallel state, model build, the collaborators it owns, memory, info
- `state`: `RankState`, what a built rank is made of; the collaborators read it
- `step`: `StepRunner`: the forward, old/reference log-probs, one rollout step (`train`) and its optimizer steps
- `optim`: one interface over torch AdamW and megatron-core's optimizer
- `checkpoint_io`: a rank's model / optimizer / RNG save and load
- `batching`: pure batch arithmetic (TrainSample, advantages, the step/rank split, micro-batch packing)
- `group`: `TrainerGroup`, the driver's view of all ranks

The loss of a micro-batch is vime_core.loss; gradient reduction and clipping vime_core.grads.
"""

from vime_core.trainer.batching import TrainSample, make_train_batch, pack_micro_batches, split_steps_and_ranks
from vime_core.trainer.group import TrainerGroup
from vime_core.trainer.rank import Trainer

__all__ = ["TrainSample", "Trainer", "TrainerGroup", "make_train_batch", "pack_micro_batches", "split_steps_and_ranks"]
