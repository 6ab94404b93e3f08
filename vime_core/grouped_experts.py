"""MoE experts as one grouped GEMM per projection, without Transformer Engine or the `grouped_gemm` package:
megatron-core's `GroupedMLP` (its weights, initialisation, EP/TP setup and torch_dist layout) with its `gmm` provided by
`torch._grouped_mm`, and the conversion between GroupedMLP's two weight tensors and SequentialMLP's per-expert names.

Why: `SequentialMLP` runs a Python loop over the local experts; at Qwen3-30B-A3B width (128 experts x [2,048 -> 768],
65,536 routed tokens, bf16, H200) one `torch._grouped_mm` took 0.32 ms against 3.82 ms for the loop (issue 25).

Layout: GroupedMLP holds `weight1` [hidden, E * 2F] and `weight2` [E * F, hidden] whose memory is read as
[E, hidden, 2F] and [E, F, hidden]: expert e's `linear_fc1.weight` transposed (its `[gate; up]` rows, TP-sharded as
SequentialMLP shards them) and its `linear_fc2.weight` transposed. Everything outside the model (the HF mapping,
exports, weight sync, conversions) keeps SequentialMLP's per-expert names: `load_full_weights` / `iter_full_weights`
(vime_core.megatron_model) convert at the model's edge with `group_experts` / `ungroup_experts`. GroupedMLP's
`sharded_state_dict` writes the same torch_dist tensors as SequentialMLP, so a checkpoint loads into either.

Imports megatron-core at module level: import it where the model is built.
"""

from __future__ import annotations

import copy
import functools
import re
from types import SimpleNamespace

import torch
from megatron.core.transformer.moe import grouped_gemm_util
from megatron.core.transformer.moe.experts import GroupedMLP

Tensor = torch.Tensor

_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")
_GROUPED = re.compile(r"(.*\.mlp\.experts\.)(weight1|weight2)")


def gmm(a: Tensor, b: Tensor, batch_sizes: Tensor, trans_b: bool = False) -> Tensor:
    """`grouped_gemm.ops.gmm` semantics over `torch._grouped_mm`: rows of `a` [tokens, K] in expert order, the first
    batch_sizes[0] rows times b[0] ([E, K, N], or [E, N, K] with trans_b), and so on; returns [tokens, N].

    `batch_sizes` may be int64 on the host (the package's contract) or on the device; torch wants the cumulative end
    rows as int32 on `a`'s device. An expert with no rows is an empty group (its weight's gradient is zero)."""
    offs = torch.cumsum(batch_sizes.to(device=a.device), 0).to(torch.int32)
    return torch._grouped_mm(a, b.transpose(-1, -2) if trans_b else b, offs=offs)


def install_torch_gmm() -> None:
    """Make megatron's `grouped_gemm_util` use `gmm` above when the `grouped_gemm` package is absent (it is not on
    the index as a wheel: it compiles CUDA at install). A real package, when installed, is left in place."""
    if grouped_gemm_util.grouped_gemm is None:
        grouped_gemm_util.grouped_gemm = SimpleNamespace(ops=SimpleNamespace(gmm=gmm))
        grouped_gemm_util.ops = grouped_gemm_util.grouped_gemm.ops


class TorchGroupedMLP(GroupedMLP):
    """megatron's GroupedMLP over `gmm`. Its forward asserts `config.bf16` because the `grouped_gemm` CUDA kernel
    takes bf16 only; `torch._grouped_mm` also computes fp32 (CPU: the equivalence tests against SequentialMLP), so
    this module keeps a copy of the config with `bf16` set, which GroupedMLP reads for that assert only."""

    def __init__(self, num_local_experts: int, config, pg_collection=None):
        install_torch_gmm()
        if not config.bf16:
            config = copy.copy(config)  # no __post_init__: the model's own config stays as it is
            config.bf16 = True
        super().__init__(num_local_experts, config, pg_collection)
        if config.use_cpu_initialization:  # a model built to run on CPU (megatron_model.transformer_config)
            # GroupedMLP wraps these two elementwise functions in torch.compile. On CPU that cost the first forward
            # 4.5 s and the first new token count 2.7 s more (tiny MoE, 2 cores), against 0.05 s a step once compiled
            # or eager: the CPU runs train tiny models, whose steps never win that back
            act = config.activation_func
            self.activation_func = functools.partial(eager_glu, act) if config.gated_linear_unit else act
            self.activation_func_with_probs = self.eager_activation_with_probs

    def eager_activation_with_probs(self, x: Tensor, probs: Tensor) -> Tensor:
        return (self.activation_func(x) * probs).to(x.dtype)


def eager_glu(act, x: Tensor) -> Tensor:
    """GroupedMLP's gated activation without torch.compile: act(gate) * up over fc1's [gate; up] halves."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return act(gate) * up


def is_grouped(state_dict_names) -> bool:
    """Whether a model's state-dict names hold GroupedMLP weights."""
    return any(_GROUPED.fullmatch(n) for n in state_dict_names)


def group_experts(local: dict[str, Tensor]) -> dict[str, Tensor]:
    """A rank's state dict with SequentialMLP experts (local ids) -> GroupedMLP's `weight1` / `weight2`."""
    out: dict[str, Tensor] = {}
    per_layer: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name, t in local.items():
        m = _LOCAL_EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            per_layer.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, parts in per_layer.items():
        for part, weight in (("linear_fc1", "weight1"), ("linear_fc2", "weight2")):
            experts = parts.get(part, {})
            if sorted(experts) != list(range(len(experts))):
                raise ValueError(f"{prefix}local_experts.*.{part}: experts {sorted(experts)} are not 0..n-1")
            stacked = torch.stack([experts[e].t() for e in range(len(experts))])  # [E, in, out], contiguous
            hidden = stacked.shape[1] if part == "linear_fc1" else stacked.shape[2]
            out[prefix + weight] = stacked.reshape(hidden, -1) if part == "linear_fc1" else stacked.reshape(-1, hidden)
    return out


def ungroup_experts(name: str, t: Tensor, num_local_experts: int) -> list[tuple[str, Tensor]]:
    """One state-dict entry -> SequentialMLP's per-expert entries (local ids) if it is a GroupedMLP weight, else
    itself. Views of `t`'s memory (transposed): callers that send them make them contiguous."""
    m = _GROUPED.fullmatch(name)
    if m is None:
        return [(name, t)]
    prefix, E = m.group(1), num_local_experts
    if m.group(2) == "weight1":
        per_expert, part = t.reshape(E, t.shape[0], -1), "linear_fc1"  # [E, hidden, 2F]
    else:
        per_expert, part = t.reshape(E, -1, t.shape[1]), "linear_fc2"  # [E, F, hidden]
    return [(f"{prefix}local_experts.{e}.{part}.weight", per_expert[e].t()) for e in range(E)]
