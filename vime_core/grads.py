"""Gradient reduction for the AdamW path, and the finiteness check of megatron's DDP buffers (used by trainer/optim.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def sync_and_clip_grads(module: torch.nn.Module, ps, clip: float, device: torch.device) -> float:
    """Sum gradients over data-parallel ranks (the loss of each rank is its share of the global loss: the sum is the
    gradient of the step), compute the global norm (TP/EP-aware), clip to `clip` (0: off). Returns the norm, equal
    on every rank. `ps` is megatron's parallel_state."""
    if ps.get_data_parallel_world_size() > 1 or ps.get_expert_data_parallel_world_size() > 1:
        for p in module.parameters():
            if p.requires_grad and p.grad is None:  # a rank with no live sample (or an idle expert) must still
                p.grad = torch.zeros_like(p)  # join every all-reduce, in the same order as the other ranks
    params = [p for p in module.parameters() if p.grad is not None]
    dense = [p for p in params if getattr(p, "allreduce", True)]
    expert = [p for p in params if not getattr(p, "allreduce", True)]
    if ps.get_data_parallel_world_size() > 1:
        for p in dense:
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
    if expert and ps.get_expert_data_parallel_world_size() > 1:
        for p in expert:
            dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group())
    if ps.get_tensor_model_parallel_world_size() > 1:
        # Qwen3's q/k layer norms are replicated over TP ranks but normalise per head, after the column-parallel
        # QKV projection: each rank sees only its own heads, so its gradient is a partial sum (megatron's
        # finalize_model_grads does the same for its optimizer).
        for name, p in module.named_parameters():
            if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    tp_rank = ps.get_tensor_model_parallel_rank()

    def sq(ps_: list[torch.Tensor]) -> torch.Tensor:
        # a TP-replicated parameter counts once (on TP rank 0); a split one on every rank
        vals = [
            p.grad.float().square().sum() for p in ps_ if getattr(p, "tensor_model_parallel", False) or tp_rank == 0
        ]
        return torch.stack(vals).sum() if vals else torch.zeros((), device=device)

    total = sq(dense) + 0.0
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_tensor_model_parallel_group())
    if expert:
        e = sq(expert)
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(e, group=ps.get_tensor_model_parallel_group())
        if ps.get_expert_model_parallel_world_size() > 1:
            dist.all_reduce(e, group=ps.get_expert_model_parallel_group())
        total = total + e
    norm = float(total.sqrt())
    if clip > 0 and norm > clip:
        coef = clip / (norm + 1e-6)
        for p in params:
            p.grad.mul_(coef)
    return norm


def megatron_grads_finite(ddp_model) -> bool:
    """Whether this rank's gradient buffers of megatron's DistributedDataParallel hold only finite values (one
    reduction per buffer). megatron's bf16/fp32 optimizer checks nothing before its step (only fp16's loss scaler
    looks for inf), so a NaN would reach every weight.

    The sum of a buffer is non-finite iff it holds a NaN or an inf (or finite values overflow fp32: also refused,
    which is safe), and needs no temporary: `isfinite(grad_data).all()` allocated a bool per gradient (1.7 GB for
    Qwen3-1.7B's fp32 buffer) at the step's memory peak."""
    bufs = ddp_model.buffers + ddp_model.expert_parallel_buffers
    return (
        bool(torch.isfinite(torch.stack([b.grad_data.sum(dtype=torch.float32) for b in bufs])).all()) if bufs else True
    )
