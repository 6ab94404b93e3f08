"""`TrainerGroup`, driver side: the trainer ranks (Ray actors, see vime_core.trainer.rank) seen as one trainer by the
loop. It turns scored rollout groups into each rank's samples (vime_core.trainer.batching) and bounds every call."""

from __future__ import annotations

import contextlib

from vime_core.config import RunConfig
from vime_core.trainer.batching import make_train_batch, split_steps_and_ranks

SHUTDOWN_GRACE_S = 3.0  # for all ranks together; a rank that is not hung only destroys its process group


class TrainerGroup:
    """The trainer ranks (Ray actors) seen as one trainer by the loop."""

    def __init__(self, actors: list, cfg: RunConfig):
        self.actors, self.cfg = actors, cfg

    def call_all(self, method: str, *args, timeout_s: float | None = None, setting: str = "train.timeout_s") -> list:
        """`method` on every rank; one that does not answer within `timeout_s` (default train.timeout_s) raises
        naming the rank, the method and the `setting` that bounds it."""
        from vime_core.rpc import call_all

        return call_all(
            self.actors,
            "trainer rank",
            method,
            args,
            timeout_s or self.cfg.train.timeout_s,
            setting if timeout_s else "train.timeout_s",
        )

    def train(self, rollout_id: int, groups: list) -> dict[str, float]:
        from vime_core.rpc import Stall, gather

        t = self.cfg.train
        samples, metrics = make_train_batch(groups, self.cfg)
        per_dp = split_steps_and_ranks(samples, self.cfg.num_steps_per_rollout, t.data_parallel_size)
        # megatron's rank order is tp-cp-ep-dp-pp: ranks of one TP group are consecutive
        futures = [
            a.train.remote(rollout_id, per_dp[rank // t.tensor_parallel_size % t.data_parallel_size])
            for rank, a in enumerate(self.actors)
        ]
        done = gather(
            futures,
            [f"trainer rank {i}" for i in range(len(futures))],
            f"train (rollout {rollout_id})",
            t.timeout_s,
            "train.timeout_s",
            Stall(t.stall_timeout_s, "train.stall_timeout_s", "no micro-batch or optimizer step finished"),
        )
        return {**metrics, **done[0]}

    def weights_checksum(self) -> float:
        return sum(self.call_all("checksum"))

    def save_checkpoint(self, ckpt_dir: str) -> None:
        self.call_all("save_checkpoint", ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> int:
        return self.call_all("load_checkpoint", ckpt_dir)[0]

    def info(self) -> list[dict]:
        return self.call_all("info")

    def offload_optimizer(self) -> dict[str, float]:
        """Colocated GPUs (train.offload_optimizer): optimizer state to host memory while vLLM generates. Rank 0's
        offload time and resident memory, {} when offload is off."""
        if not getattr(self, "_offload", True):
            return {}
        results = self.call_all("offload_optimizer")
        self._offload = all(r is not None for r in results)
        return results[0] or {}

    def onload_optimizer(self) -> None:
        if getattr(self, "_offload", True):
            self._offload = all(self.call_all("onload_optimizer"))

    def shutdown(self) -> None:
        """Every rank leaves its process group at once, then all are killed: a rank hung in a call never runs its
        `shutdown` (Ray runs an actor's calls one at a time). Measured on the 2-core box with stand-in ranks hung in
        `train`: 30.1 s for one hung rank of 2 and 60.0 s for two of 3 when each got 30 s in turn; 3.0 s for both
        now."""
        import ray

        refs = []
        for a in self.actors:
            with contextlib.suppress(Exception):  # the actor may already be gone
                refs.append(a.shutdown.remote())
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_GRACE_S)
        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
