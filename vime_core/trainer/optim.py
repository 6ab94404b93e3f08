"""One optimizer interface over torch AdamW and megatron-core's optimizer: build, zero the gradients, and one step
(reduce, clip, NaN guard, apply at a learning rate). The step itself (`trainer.step`) never asks which one it has.

torch AdamW runs on every platform (the only one on CPU, where megatron's optimizer is CUDA-only); megatron-core's
(DistributedOptimizer when DP > 1 and train.distributed_optimizer) keeps fp32 main params and its DDP gradient
buffers, so `model` is then the DDP wrapper while `module` stays the GPTModel.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from vime_core.config import RunConfig
from vime_core.grads import megatron_grads_finite, sync_and_clip_grads
from vime_core.loss import NonFiniteStepError, check_finite_step, set_step_schedule


class OptimizerAdapter(ABC):
    """`optimizer` (the torch / megatron object: its state_dict is what a checkpoint saves), `model` (what the
    forward runs and offload moves: the GPTModel, or megatron's DDP around it) and `kind` (adamw | megatron)."""

    kind = ""

    def __init__(self, optimizer, model):
        self.optimizer, self.model = optimizer, model

    @abstractmethod
    def zero_grad(self) -> None:
        """Before the first micro-batch of an optimizer step."""

    @abstractmethod
    def apply(self, lr: float, loss: float, where: str) -> float:
        """Reduce, clip and apply the accumulated gradients at learning rate `lr`; returns the global grad norm.
        A non-finite `loss` (the step's, equal on every rank) or gradient raises NonFiniteStepError on every rank
        before the optimizer touches the weights or its moments; `where` names the step in that error."""

    def checkpoint_state(self) -> dict:
        """This rank's optimizer state for a checkpoint (tensors may live on the device or the host)."""
        return {"optimizer": self.optimizer.state_dict()}

    def load_checkpoint_state(self, blob: dict) -> None:
        """The inverse of `checkpoint_state`, on a freshly built optimizer. May move the weights (megatron's host
        optimizer takes a throw-away step to allocate its state): load the model weights after it."""
        self.optimizer.load_state_dict(blob["optimizer"])


class TorchAdamW(OptimizerAdapter):
    """torch AdamW (params in cfg.model.dtype); gradients summed over DP and clipped by vime_core.grads."""

    kind = "adamw"

    def __init__(self, cfg: RunConfig, module: torch.nn.Module, ps, device: torch.device):
        t = cfg.train
        decay, no_decay = [], []
        for p in module.parameters():
            (no_decay if p.ndim < 2 else decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
        )
        fuse_adam([optimizer])  # on a GPU (see fuse_adam); CPU runs keep torch's default kernel
        super().__init__(optimizer, module)
        self.module, self.ps, self.clip_grad, self.device = module, ps, t.clip_grad, device

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def apply(self, lr: float, loss: float, where: str) -> float:
        set_step_schedule(self.optimizer.param_groups, lr, None)
        # sum over data-parallel ranks, the global norm (TP/EP-aware), clip: the same value on every rank
        grad_norm = sync_and_clip_grads(self.module, self.ps, self.clip_grad, self.device)
        check_finite_step(loss, grad_norm, where)
        self.optimizer.step()
        return grad_norm


class MegatronOptimizer(OptimizerAdapter):
    """megatron-core's optimizer with fp32 main params over its DDP gradient buffers (GPU only)."""

    kind = "megatron"

    def __init__(self, cfg: RunConfig, module: torch.nn.Module, tf_config, device: torch.device):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        t = cfg.train
        offload = t.optimizer_cpu_offload
        # megatron runs its host-side optimizer (HybridDeviceOptimizer) only inside the distributed optimizer, and
        # only in its precision-aware mode: the GPU then keeps no fp32 master copy (HDO holds it on the host)
        distributed = (t.distributed_optimizer and t.data_parallel_size > 1) or offload
        model = DistributedDataParallel(
            tf_config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed
            ),
            module=module,
        )
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            bf16=cfg.model.dtype == "bfloat16",
            params_dtype=tf_config.params_dtype,
            use_distributed_optimizer=distributed,
            optimizer_cpu_offload=offload,
            optimizer_offload_fraction=t.optimizer_offload_fraction if offload else 0.0,
            overlap_cpu_optimizer_d2h_h2d=offload,  # each parameter's host Adam starts when its grads land
        )
        if offload:
            # the precision-aware mode, set after __post_init__: there it asks Transformer Engine's version, which
            # raises without TE (megatron-core 0.16.1). These are the values __post_init__ sets for a CPU-offloaded
            # optimizer; master and moments stay fp32 (main_params_dtype / exp_avg_dtype keep their defaults).
            opt_config.use_precision_aware_optimizer = True
            opt_config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
            opt_config.store_param_remainders = False
        optimizer = get_megatron_optimizer(opt_config, [model])
        if offload:
            release_cached_host_memory()
        fuse_adam(inner_optimizers(optimizer))
        super().__init__(optimizer, model)
        self.weight_decay, self.device, self.distributed = t.weight_decay, device, distributed

    def checkpoint_state(self) -> dict:
        """The distributed optimizer's `state_dict()` holds only the param groups and the step; the fp32 masters
        and moments of this DP rank's shard (on the host for the part train.optimizer_cpu_offload moved there) come
        from megatron's bucket-order view of them, which references the live tensors: torch.save copies a device
        tensor to the host one at a time and writes host tensors directly, so a save stages nothing whole."""
        blob = super().checkpoint_state()
        if self.distributed:  # one list per part of megatron's ChainedOptimizer (e.g. dense and expert params)
            blob["param_state"] = [
                [{k: elem[k] for k in SHARD_STATE_KEYS} for elem in bucket_elements(part)]
                for part in optimizer_parts(self.optimizer)
            ]
        return blob

    def load_checkpoint_state(self, blob: dict) -> None:
        super().load_checkpoint_state(blob)  # allocates the state (HybridDeviceOptimizer: a dummy step)
        fuse_adam(inner_optimizers(self.optimizer))  # torch's loader takes the saved groups' flags
        if not self.distributed:
            return
        parts = optimizer_parts(self.optimizer)
        live = [len(bucket_elements(part)) for part in parts]
        saved = [len(shards) for shards in blob["param_state"]]
        if live != saved:
            raise ValueError(
                f"the checkpoint's optimizer state has {saved} parameter shards, this optimizer {live}: "
                "it was saved with another model or data-parallel layout"
            )
        for part, shards in zip(parts, blob["param_state"]):
            # megatron's loader for shards in this same order: it copies the masters into the host optimizer's
            # fp32 params and moves every moment to the device its half of the optimizer steps on
            part.load_parameter_state_from_fs_model_space(
                {
                    i: {"fp32_param": e["param"], "exp_avg": e["exp_avg"], "exp_avg_sq": e["exp_avg_sq"]}
                    for i, e in enumerate(shards)
                }
            )
            # without Transformer Engine or Apex, megatron's load_state_dict gives every parameter's state one
            # shared `step` tensor, and torch's Adam increments its own in place: the host half (one optimizer per
            # parameter) then counts a step once per parameter. The first GPU resume test differed from the
            # second resumed step on; each state gets its own copy.
            for st in part.optimizer.state.values():
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].clone()
            if hasattr(part.optimizer, "sub_optimizers"):  # HybridDeviceOptimizer
                place_beside_params(part.optimizer.sub_optimizers)

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def apply(self, lr: float, loss: float, where: str) -> float:
        from megatron.core.distributed import finalize_model_grads

        set_step_schedule(self.optimizer.param_groups, lr, self.weight_decay)
        # DP all-reduce (or reduce-scatter), plus the TP sum of the q/k layer-norm gradients (see vime_core.grads)
        finalize_model_grads([self.model])
        # megatron's bf16/fp32 optimizer checks nothing (only fp16's loss scaler looks for inf): check the buffers
        check_finite_step(
            loss, None if all_ranks_ok(megatron_grads_finite(self.model), self.device) else math.nan, where
        )
        ok, grad_norm, _ = self.optimizer.step()  # clips by the global norm itself
        if not ok:
            raise NonFiniteStepError(
                f"{where}: megatron's optimizer found non-finite gradients; the step was not applied"
            )
        return float(grad_norm)


SHARD_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # a shard's fp32 master and its Adam moments


def optimizer_parts(optimizer) -> list:
    """The distributed optimizers inside megatron's ChainedOptimizer (get_megatron_optimizer returns one), or
    `optimizer` itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def bucket_elements(dist_optimizer) -> list[dict]:
    """megatron's distributed optimizer state per parameter shard, in its fixed bucket order, as references to the
    live tensors (`get_parameter_state_dp_reshardable`: fp32 `param`, `exp_avg`, `exp_avg_sq`, ...)."""
    state = dist_optimizer.get_parameter_state_dp_reshardable()
    out = []
    for gbuf_idx in sorted(k for k in state if isinstance(k, int)):
        for buckets in state[gbuf_idx].values():
            for bucket in buckets:
                out.extend(bucket)
    return out


def inner_optimizers(optimizer) -> list:
    """The torch optimizers inside megatron's (ChainedOptimizer -> mixed-precision wrapper -> torch optimizer)."""
    return [getattr(part, "optimizer", part) for part in optimizer_parts(optimizer)]


def fuse_adam(optimizers, device_type: str = "cuda") -> None:
    """torch's fused Adam kernel for every Adam(W) whose parameters are all on `device_type`. Without Transformer
    Engine or Apex megatron-core builds a plain torch AdamW, whose default (foreach) step allocates a temporary as
    large as every fp32 master parameter (the square roots of exp_avg_sq): 4 bytes a parameter on top of the resident
    16. Qwen3-30B-A3B's shape at 10 layers on one H200 ran out of memory in that step at 133 GiB; the fused kernel
    updates in place. Same formula, the same within float rounding. Others (HybridDeviceOptimizer, whose halves are
    fused already) are left alone."""
    fused = []
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Adam):  # AdamW is an Adam
            continue
        for group in opt.param_groups:
            if group["params"] and all(p.device.type == device_type for p in group["params"]):
                group["fused"], group["foreach"] = True, False
                fused.append(opt)
    # the fused kernel wants each `step` on its parameter's device; only these: the hybrid optimizer's own state
    # view keeps the host half's state on the host on purpose
    place_beside_params(list(dict.fromkeys(fused)))


def place_beside_params(optimizers) -> None:
    """Every optimizer state tensor on its parameter's device (`step` too where the group is fused or capturable,
    as torch's own loader places it). megatron-core 0.16.1's HybridDeviceOptimizer, after loading a state, moves the
    state of every sub-optimizer of its CPU optimizer's class to the host; without Transformer Engine or Apex its
    GPU half is of that same class (torch AdamW), so the GPU half's moments landed on the host and its first fused
    step failed ("exp_avgs is on cpu"). The sub-optimizers' state dicts are the hybrid optimizer's own, so one pass
    fixes both views."""
    for opt in optimizers:
        for group in opt.param_groups:
            step_on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                st = opt.state.get(p, {})
                for k, v in st.items():
                    dev = p.device if (k != "step" or step_on_device) else torch.device("cpu")
                    if torch.is_tensor(v) and v.device != dev:
                        st[k] = v.to(dev)


def make_optimizer(
    cfg: RunConfig, platform: str, module: torch.nn.Module, tf_config, ps, device: torch.device
) -> OptimizerAdapter:
    """train.optimizer: `auto` is adamw on CPU, megatron on a GPU."""
    kind = cfg.train.optimizer
    if kind == "auto":
        kind = "adamw" if platform == "cpu" else "megatron"
    if kind == "megatron":
        if platform == "cpu":
            raise ValueError(
                "train.optimizer = megatron needs a GPU (megatron-core's optimizer is CUDA-only); use adamw"
            )
        return MegatronOptimizer(cfg, module, tf_config, device)
    return TorchAdamW(cfg, module, ps, device)


def all_ranks_ok(flag: bool, device: torch.device) -> bool:
    """`flag` ANDed over every trainer rank (one tiny all-reduce), so that all ranks stop together."""
    t = torch.tensor([0.0 if flag else 1.0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t) == 0.0


def release_cached_host_memory() -> None:
    """HybridDeviceOptimizer stages each parameter through a pinned bf16 copy that it drops at once; torch's pinned
    allocator keeps such blocks cached (2 bytes per offloaded parameter: 15 GiB for Qwen3-8B) unless told."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()
