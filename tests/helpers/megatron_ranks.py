"""Megatron rank workers for tests/integration/test_conversion.py. They live in an importable module so that
torch.multiprocessing's spawn can start them; each rank is a fresh gloo process set up by
`vime_core.checkpoint.init_rank`."""

from __future__ import annotations

import torch

from tests.helpers.spawn_ranks import spawn_ranks


def spawn(fn_name: str, world: int, *args, timeout: float = 300.0) -> list:
    """Run `<this module>.<fn_name>(rank, world, port, *args)` in `world` spawned processes (see spawn_ranks)."""
    return spawn_ranks(__name__, fn_name, world, *args, timeout=timeout)


def _set_layout(rank: int, world: int, port: int, tp: int, pp: int, ep: int, first: bool) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from vime_core.checkpoint import init_rank

    if first:
        init_rank(rank, world, port, tp, pp, ep)
        return
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)


def _forward(model, ids: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits [b, s, V] on the last pipeline stage (None elsewhere). Stages hand activations on by send/recv."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    if not ps.is_pipeline_first_stage():
        hidden = torch.empty(s, b, model.config.hidden_size, dtype=model.config.params_dtype)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return gather_from_tensor_model_parallel_region(out)


def load_and_forward(rank: int, world: int, port: int, jobs: list[dict], token_ids: list[list[int]]) -> dict:
    """For each job {name, hf_dir (the model's config), ckpt, tp, pp, ep}: build the megatron model at that layout,
    check and load the torch_dist checkpoint, run a forward on `token_ids`. Returns {name: logits as numpy} from the
    ranks that hold the last stage, or {name: "ConversionError: ..."} when the check refuses the checkpoint."""
    from vime_core import megatron_model as mm
    from vime_core.checkpoint import ConversionError, load_torch_dist, read_hf_config
    from vime_core.models import arch_from_hf_config

    out: dict = {}
    for i, job in enumerate(jobs):
        tp, pp, ep = job.get("tp", 1), job.get("pp", 1), job.get("ep", 1)
        _set_layout(rank, world, port, tp, pp, ep, first=i == 0)
        arch = arch_from_hf_config(read_hf_config(job["hf_dir"]))
        model = mm.build_gpt(arch, mm.transformer_config(arch, "float32", tp=tp, ep=ep, pp=pp)).eval()
        try:
            load_torch_dist(model, job["ckpt"])
        except ConversionError as e:
            out[job["name"]] = f"ConversionError: {e}"
            continue
        with torch.no_grad():
            logits = _forward(model, torch.tensor(token_ids))
        if logits is not None:
            out[job["name"]] = logits.float().numpy()
    return out
