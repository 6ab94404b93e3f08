"""Forward + backward time of the trainer's per-layer pieces against alternative formulations (GPU diagnostic, issue 13).

    python3 bench/kernel_variants.py [--lens 4136,4136] [--lens 4150,4090] [--out FILE]

Qwen3-1.7B layer shapes (16 query heads, 8 KV heads, head_dim 128, hidden 2048, ffn 6144, bf16) on one packed
micro-batch of samples of `--lens` tokens. Each block times the formulation the trainer uses today (the first
row) beside the others on the same inputs, and checks that their outputs and input gradients agree with it:

- attention: vime_core.attention.varlen_attention (length groups padded by index copies) / one SDPA call per sample
  on views of the packed row / flash-attention's variable-length kernel (no padding, no copies);
- swiglu: megatron's unfused glu (chunk, silu, + 0, mul) / megatron's fused SwiGLUFunction (torch.compile);
- rope: megatron's thd rotary path (per-sequence frequency slices, ~10 elementwise passes) / one compiled kernel on
  per-token cos/sin computed once per micro-batch.

Prints per block `name: ms (x of the first row), max |diff|` and the CUDA kernels each variant launched.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, FFN = 16, 8, 128, 2048, 6144
DEV = "cuda"  # --device cpu: a smoke test of the script (no timing worth reading; flash varlen fails there)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, inputs: list[torch.Tensor], grad: torch.Tensor, reps: int = 10) -> tuple[float, torch.Tensor, list]:
    """Median ms of fn(*inputs) forward + backward(grad); the output and the inputs' gradients of one run."""
    for x in inputs:
        x.grad = None
    for _ in range(3):
        fn(*inputs).backward(grad)
    times = []
    for _ in range(reps):
        for x in inputs:
            x.grad = None
        sync()
        t = time.perf_counter()
        out = fn(*inputs)
        out.backward(grad)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), out.detach(), [x.grad.clone() for x in inputs]


def kernels(fn, inputs, grad, top: int = 6) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    if DEV != "cuda":
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*inputs).backward(grad)
        rows = sorted(
            (e for e in prof.key_averages() if e.device_type.name == "CUDA"), key=lambda e: -e.self_device_time_total
        )
    return [f"{e.key[:80]} x{e.count} {e.self_device_time_total / 1e3:.2f}ms" for e in rows[:top]]


def compare(name: str, variants: dict, inputs, grad) -> dict:
    base = None
    out = {}
    for label, fn in variants.items():
        try:
            ms, y, grads = timed(fn, inputs, grad)
        except Exception as e:  # a formulation this torch/GPU does not support: report, go on
            print(f"[{name}] {label}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            out[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        if base is None:
            base = (ms, y, grads)
        diff = max(
            [(y.float() - base[1].float()).abs().max().item()]
            + [(g.float() - b.float()).abs().max().item() for g, b in zip(grads, base[2])]
        )
        ks = kernels(fn, inputs, grad)
        out[label] = {"ms": ms, "x_first": ms / base[0], "max_abs_diff": diff, "kernels": ks}
        print(f"[{name}] {label}: {ms:.3f} ms ({ms / base[0]:.2f}x), max |diff| {diff:.2e}", flush=True)
        for k in ks:
            print(f"      {k}", flush=True)
    return out


# -- attention ----------------------------------------------------------------------------------------------------
class FlashVarlen(torch.autograd.Function):
    """Causal attention within each sample of a packed row through flash-attention's variable-length kernels."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            g.contiguous(),
            q,
            k,
            v,
            out,
            lse,
            cu,
            cu,
            ctx.max_len,
            ctx.max_len,
            0.0,
            True,
            rng,
            unused,
            scale=ctx.scale,
        )
        return dq, dk, dv, None, None, None


def attention_block(lens: list[int]) -> dict:
    from vime_core.attention import sdpa, varlen_attention, varlen_layout

    t = sum(lens)
    dev = DEV
    q = torch.randn(t, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(t, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5
    layout = varlen_layout(lens, dev)
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32, device=dev)
    starts = cu.tolist()[:-1]

    def per_sample(q, k, v, contiguous=False):
        outs = []
        for s, n in zip(starts, lens):
            part = [x.narrow(0, s, n).transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
            if contiguous:
                part = [p.contiguous() for p in part]
            outs.append(sdpa(*part, scale=scale, causal=True)[0].transpose(0, 1))
        return torch.cat(outs)

    variants = {
        "padded groups (today)": lambda q, k, v: varlen_attention(q, k, v, layout, scale),
        "per-sample views": per_sample,
        "per-sample contiguous": lambda q, k, v: per_sample(q, k, v, True),
        "flash varlen": lambda q, k, v: FlashVarlen.apply(q, k, v, cu, max(lens), scale),
    }
    if len(set(lens)) == 1:
        n = lens[0]

        def equal_view(q, k, v):
            part = [x.view(len(lens), n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)]
            return sdpa(*part, scale=scale, causal=True).transpose(1, 2).reshape(t, HEADS, HEAD_DIM)

        variants["equal lengths: one view"] = equal_view
    return compare(f"attention {lens}", variants, [q, k, v], grad)


# -- swiglu -------------------------------------------------------------------------------------------------------
def swiglu_block(tokens: int) -> dict:
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    x = torch.randn(tokens, 1, 2 * FFN, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, 1, FFN, device=DEV, dtype=torch.bfloat16)

    def glu(x):  # megatron's MLP without bias_activation_fusion
        a, b = torch.chunk(x, 2, dim=-1)
        return F.silu(a) * (b + 0.0)

    return compare(
        f"swiglu {tokens}", {"glu (today)": glu, "fused SwiGLUFunction": lambda x: bias_swiglu_impl(x, None)}, [x], grad
    )


# -- rope ---------------------------------------------------------------------------------------------------------
class _CP:
    def size(self):
        return 1

    def rank(self):
        return 0


def rope_block(lens: list[int]) -> dict:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    t = sum(lens)
    dim = HEAD_DIM
    inv = 1.0 / (1_000_000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=DEV) / dim))
    pos = torch.cat([torch.arange(n, device=DEV, dtype=torch.float32) for n in lens])
    freqs_max = torch.outer(torch.arange(max(lens), device=DEV, dtype=torch.float32), inv)
    freqs_max = torch.cat([freqs_max, freqs_max], -1)[:, None, None, :]  # megatron's [s, 1, 1, d]
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    f = torch.outer(pos, inv)
    cos = torch.cat([f, f], -1).cos().to(torch.bfloat16)[:, None, :]
    sin = torch.cat([f, f], -1).sin().to(torch.bfloat16)[:, None, :]
    q = torch.randn(t, HEADS, dim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(q)

    def rope(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    compiled = torch.compile(rope, dynamic=True)
    return compare(
        f"rope {lens}",
        {
            "megatron thd (today)": lambda x: _apply_rotary_pos_emb_thd(x, cu, freqs_max, cp_group=_CP()),
            "eager, cos/sin once": lambda x: rope(x, cos, sin),
            "compiled, cos/sin once": lambda x: compiled(x, cos, sin),
        },
        [q],
        grad,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lens", action="append", help="comma-separated sample lengths of one micro-batch")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    cases = [[int(x) for x in s.split(",")] for s in (args.lens or ["4136,4136", "4150,4090"])]
    torch.manual_seed(0)
    results = {
        "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV,
        "torch": torch.__version__,
        "blocks": {},
    }
    for lens in cases:
        results["blocks"][f"attention {lens}"] = attention_block(lens)
        results["blocks"][f"rope {lens}"] = rope_block(lens)
    results["blocks"]["swiglu"] = swiglu_block(sum(cases[0]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
