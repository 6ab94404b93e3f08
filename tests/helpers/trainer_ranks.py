"""Trainer ranks in spawned gloo processes, for tests/integration/test_loss.py: the real `Trainer` (megatron-core
GPTModel of the builtin tiny model, torch AdamW) on CPU without Ray, and megatron's DistributedDataParallel on its own.

Functions here run as `fn(rank, world, port, *args)` in `world` fresh processes (see `spawn`) and return plain
objects (floats, lists), never tensors.
"""

from __future__ import annotations

import random
from pathlib import Path

from tests.helpers.spawn_ranks import spawn_ranks

REPO_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.yaml")


def spawn(fn_name: str, world: int, *args, timeout: float = 300.0) -> list:
    """Run `<this module>.<fn_name>(rank, world, port, *args)` in `world` spawned processes (see spawn_ranks)."""
    return spawn_ranks(__name__, fn_name, world, *args, timeout=timeout)


def init_gloo_rank(rank: int, world: int, port: int) -> None:
    """torch.distributed over gloo and megatron's parallel state (TP = PP = EP = 1) on CPU."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from vime_core.platform import apply_megatron_cpu_shims, apply_offline_env

    apply_offline_env()
    apply_megatron_cpu_shims()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1
    )
    model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)


def synthetic_samples(n: int, vocab: int, seed: int = 0, empty_every: int = 0, masked: bool = True) -> list:
    """`n` TrainSamples with random tokens, responses of 2-7 tokens (every `empty_every`-th one empty), partly
    masked, rollout log-probs near -2 and advantages of consecutive groups of 4."""
    import torch

    from vime_core.algo import group_advantages
    from vime_core.trainer import TrainSample

    rng = random.Random(seed)
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in range(n)])
    adv = group_advantages(rewards, 4).tolist()
    out = []
    for i in range(n):
        plen = rng.randint(2, 5)
        rlen = 0 if empty_every and i % empty_every == 0 else rng.randint(2, 7)
        mask = [1 if not masked or j < 2 or rng.random() < 0.6 else 0 for j in range(rlen)]
        out.append(
            TrainSample(
                tokens=[rng.randrange(3, vocab) for _ in range(plen + rlen)],
                prompt_len=plen,
                loss_mask=mask,
                rollout_logprobs=[-2.0 + rng.uniform(-0.3, 0.3) for _ in range(rlen)],
                advantage=adv[i],
            )
        )
    return out


def train_rank(
    rank: int,
    world: int,
    port: int,
    model_dir: str,
    overrides: list[str],
    n_samples: int,
    empty_every: int = 0,
    nan_advantage: bool = False,
) -> dict:
    """Build the real Trainer with the tiny config + `overrides` (train.num_devices = world), train one rollout
    step on `synthetic_samples(n_samples)` split over the DP ranks, return {metrics, checksum before/after, error}."""
    import math

    import torch

    from vime_core.config import load_config
    from vime_core.trainer import Trainer, split_steps_and_ranks

    cfg = load_config(REPO_CONFIG, [f"train.num_devices={world}", "train.cpu_threads=1", *overrides])
    trainer = Trainer(cfg, model_dir, rank, world, "127.0.0.1", port, "cpu")
    samples = synthetic_samples(n_samples, trainer.state.arch.vocab_size, empty_every=empty_every)
    if nan_advantage:
        samples[1].advantage = math.nan
    steps = split_steps_and_ranks(samples, cfg.num_steps_per_rollout, cfg.train.data_parallel_size)[rank]
    before = trainer.checksum()
    out: dict = {"error": None, "metrics": {}, "old_logprob_samples": 0}
    no_grad_pass = trainer.steps.logprobs

    def counted(model, samples):  # samples of the no-grad forwards of the policy (the old log-probs)
        if model is trainer.state.model:
            out["old_logprob_samples"] += len(samples)
        return no_grad_pass(model, samples)

    trainer.steps.logprobs = counted
    try:
        out["metrics"] = trainer.train(0, steps)
    except Exception as e:  # the test looks at the message and at the weights
        out["error"] = f"{type(e).__name__}: {e}"
    out["checksum_before"], out["checksum_after"] = before, trainer.checksum()
    out["finite_weights"] = all(bool(torch.isfinite(p).all()) for p in trainer.state.module.parameters())
    out["adam_steps"] = sum(len(s) for s in trainer.state.optimizer.state.values())
    trainer.shutdown()
    return out


def megatron_ddp_grads(rank: int, world: int, port: int, model_dir: str, loss_factor: float) -> list[float]:
    """The tiny GPT in megatron's DistributedDataParallel on gloo; rank r backs (loss of its own tokens) x
    `loss_factor` / world (its share of the mean over all ranks), then finalize_model_grads. Returns the
    first 64 entries of the reduced gradient buffer, and what megatron_grads_finite says before and after a NaN is
    put into the buffer."""
    import torch
    from megatron.core.distributed import finalize_model_grads

    from vime_core.grads import megatron_grads_finite

    model, arch = tiny_ddp_model(rank, world, port, model_dir)
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(3, arch.vocab_size, (2, 6), generator=g)
    pos = torch.arange(6).unsqueeze(0).expand(2, 6)
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)[None, None]
    logits = model(input_ids=ids, position_ids=pos, attention_mask=mask)
    loss = logits.float().square().mean() / world  # this rank's share of the mean over every rank's tokens
    (loss * loss_factor).backward()
    finalize_model_grads([model])
    grads = model.buffers[0].grad_data[:64].tolist()
    finite = megatron_grads_finite(model)
    model.buffers[0].grad_data[-1] = float("nan")  # what the trainer's guard must see before megatron's step
    return {"grads": grads, "finite": finite, "finite_after_nan": megatron_grads_finite(model)}


def plain_grads(rank: int, world: int, port: int, model_dir: str) -> list[float]:
    """Reference for megatron_ddp_grads: one process, the same per-rank batches (seeds 1000 + r for r < 2), the loss
    summed over them (each divided by 2), plain autograd; the same 64 buffer entries (DDP's buffer order)."""
    import torch

    model, arch = tiny_ddp_model(rank, world, port, model_dir)
    pos = torch.arange(6).unsqueeze(0).expand(2, 6)
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)[None, None]
    for r in range(2):
        ids = torch.randint(3, arch.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1000 + r))
        (model(input_ids=ids, position_ids=pos, attention_mask=mask).float().square().mean() / 2).backward()
    return model.buffers[0].grad_data[:64].tolist()


def tiny_ddp_model(rank: int, world: int, port: int, model_dir: str):
    """This gloo rank's builtin model (fp32) inside megatron's DistributedDataParallel; -> (model, arch)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from vime_core import megatron_model as mm
    from vime_core.checkpoint import load_hf_state_dict, read_hf_config
    from vime_core.models import arch_from_hf_config
    from vime_core.models.qwen3_mapping import hf_to_mcore

    init_gloo_rank(rank, world, port)
    arch = arch_from_hf_config(read_hf_config(model_dir))
    cfg = mm.transformer_config(arch, "float32")
    module = mm.build_gpt(arch, cfg)
    mm.load_full_weights(module, hf_to_mcore(load_hf_state_dict(model_dir), arch), arch)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    return DistributedDataParallel(cfg, ddp, module=module), arch


def deferred_start(rank: int, world: int, port: int, model_dir: str) -> dict:
    """A Trainer made with defer_start (colocated GPUs): what exists before and after start(), called twice."""
    import torch.distributed as dist

    from vime_core.config import load_config
    from vime_core.trainer import Trainer

    cfg = load_config(REPO_CONFIG, [f"train.num_devices={world}", "train.cpu_threads=1"])
    trainer = Trainer(cfg, model_dir, rank, world, "127.0.0.1", port, "cpu", defer_start=True)
    before = {"model": trainer.state is not None, "process_group": dist.is_initialized()}
    first, again = trainer.start(), trainer.start()
    return {"before": before, "first": first, "again": again, "model": trainer.state is not None}


def static_memory(rank: int, world: int, port: int, model_dir: str, overrides: list[str]) -> dict:
    """The real Trainer after one training step: the bytes its parameters (policy and reference), gradients and
    optimizer state take (measured by walking the tensors), beside vime_core.fit's estimate of the same."""
    import torch

    from vime_core.config import load_config
    from vime_core.fit import trainer_static
    from vime_core.models import Layout, spec_of
    from vime_core.trainer import Trainer, split_steps_and_ranks

    cfg = load_config(REPO_CONFIG, [f"train.num_devices={world}", "train.cpu_threads=1", *overrides])
    trainer = Trainer(cfg, model_dir, rank, world, "127.0.0.1", port, "cpu")
    samples = synthetic_samples(8, trainer.state.arch.vocab_size)
    dp_rank = rank // cfg.train.model_parallel_size  # TP ranks of one DP group train the same samples
    trainer.train(0, split_steps_and_ranks(samples, cfg.num_steps_per_rollout, cfg.train.data_parallel_size)[dp_rank])

    def nbytes(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    params = list(trainer.state.module.parameters())
    ref = list(trainer.state.ref_model.parameters()) if trainer.state.ref_model is not None else []
    states = [
        t for st in trainer.state.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim() > 0
    ]
    measured = nbytes(params) + nbytes(ref) + nbytes(p.grad for p in params) + nbytes(states)
    counted = spec_of(trainer.state.arch).params_per_device(trainer.state.arch, Layout.of_config(cfg))
    estimate = sum(trainer_static(cfg, counted, "cpu")[k] for k in ("weights", "grads", "optimizer_gpu"))
    out = {"measured": measured, "estimate": estimate, "params": sum(p.numel() for p in params), "counted": counted}
    trainer.shutdown()
    return out


def optimizer_run(rank: int, world: int, port: int, model_dir: str, overrides: list[str], rollouts: int) -> dict:
    """The real Trainer on this machine's GPU (tests/integration/test_optimizer_offload.py): `rollouts` training steps
    on fixed synthetic samples, each followed by the between-phase offload and onload the loop does; returns the weights
    (flattened, as a list), the Adam moments' totals and the per-step grad norms."""
    import torch

    from vime_core.config import load_config
    from vime_core.trainer import Trainer, split_steps_and_ranks

    cfg = load_config(REPO_CONFIG, [f"train.num_devices={world}", "cluster.platform=cuda", *overrides])
    trainer = Trainer(cfg, model_dir, rank, world, "127.0.0.1", port, "cuda")
    samples = synthetic_samples(8, trainer.state.arch.vocab_size)
    start = torch.cat([p.detach().float().flatten().cpu() for p in trainer.state.module.parameters()])
    norms = []
    for r in range(rollouts):
        steps = split_steps_and_ranks(samples, cfg.num_steps_per_rollout, cfg.train.data_parallel_size)[rank]
        norms.append(trainer.train(r, steps)["train/grad_norm"])
        trainer.offload_optimizer()
        trainer.onload_optimizer()
    inner = getattr(trainer.state.optimizer, "optimizer", trainer.state.optimizer)
    states = [st for st in inner.state.values()]
    weights = torch.cat([p.detach().float().flatten().cpu() for p in trainer.state.module.parameters()])
    out = {
        "weights": weights.tolist(),
        "moved": float((weights - start).abs().max()),
        "exp_avg": sum(float(st["exp_avg"].double().abs().sum()) for st in states),
        "exp_avg_sq": sum(float(st["exp_avg_sq"].double().sum()) for st in states),
        "grad_norms": norms,
        "optimizer": type(inner).__name__,
        "gpu_allocated_gib": torch.cuda.memory_allocated() / 2**30,
    }
    trainer.shutdown()
    return out


def optimizer_resume(
    rank: int, world: int, port: int, model_dir: str, overrides: list[str], ckpt: str, before: int, after: int
) -> dict:
    """The real Trainer on this machine's GPU (tests/integration/test_optimizer_offload.py): `before` steps then a
    checkpoint into `ckpt` when `before` > 0; with `before` = 0, a fresh trainer that loads `ckpt` first. Then `after`
    more steps; returns the weights and the optimizer's fp32 masters and moments (flattened lists) and the grad
    norms."""
    import torch

    from vime_core.config import load_config
    from vime_core.trainer import Trainer, split_steps_and_ranks
    from vime_core.trainer.optim import SHARD_STATE_KEYS, bucket_elements, optimizer_parts

    cfg = load_config(REPO_CONFIG, [f"train.num_devices={world}", "cluster.platform=cuda", *overrides])
    # the config refuses save_optimizer with the host optimizer until this test passes on a GPU: set it past the check
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"save_optimizer": True})})
    trainer = Trainer(cfg, model_dir, rank, world, "127.0.0.1", port, "cuda")
    samples = synthetic_samples(8, trainer.state.arch.vocab_size)
    first = 0
    if before == 0:
        first = trainer.load_checkpoint(ckpt) // cfg.num_steps_per_rollout  # the rollouts the checkpoint covers
    norms = []
    for r in range(before + after):
        steps = split_steps_and_ranks(samples, cfg.num_steps_per_rollout, cfg.train.data_parallel_size)[rank]
        norms.append(trainer.train(first + r, steps)["train/grad_norm"])
        trainer.offload_optimizer()
        trainer.onload_optimizer()
        if r + 1 == before:
            trainer.save_checkpoint(ckpt)
    flat = {k: [] for k in SHARD_STATE_KEYS}
    for part in optimizer_parts(trainer.state.optimizer):
        for elem in bucket_elements(part):
            for k in SHARD_STATE_KEYS:
                flat[k].append(elem[k].detach().float().flatten().cpu())
    out = {k: torch.cat(v).tolist() for k, v in flat.items()}
    out["weights"] = torch.cat([p.detach().float().flatten().cpu() for p in trainer.state.module.parameters()]).tolist()
    out["grad_norms"], out["step"] = norms, trainer.state.step
    trainer.shutdown()
    return out


def with_routing(samples: list, arch, seed: int) -> list:
    """The samples carrying an engine's routed experts, as R3 replays them: [tokens - 1, MoE layers, top_k], a random
    set of distinct experts per (token, layer), int16 as vLLM returns them."""
    from dataclasses import replace

    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        scores = torch.rand(len(s.tokens) - 1, arch.num_layers, arch.num_experts, generator=g)
        out.append(replace(s, routed_experts=scores.argsort(-1)[..., : arch.moe_topk].to(torch.int16).numpy()))
    return out


def expert_parallel_run(rank: int, world: int, port: int, model_dir: str, overrides: list[str], rollouts: int) -> dict:
    """The real Trainer of the tiny MoE at `overrides` (tests/integration/test_expert_parallel.py): `rollouts` rollout
    steps on synthetic samples of uneven lengths; returns each step's train/* metrics, the full weights after them
    (every expert, gathered over EP ranks, by name) and the padding tokens this rank's lockstep micro-batches took."""
    from vime_core.config import load_config
    from vime_core.megatron_model import iter_full_weights
    from vime_core.trainer import Trainer, split_steps_and_ranks

    cfg = load_config(REPO_CONFIG, [f"train.num_devices={world}", "train.cpu_threads=1", *overrides])
    trainer = Trainer(cfg, model_dir, rank, world, "127.0.0.1", port, "cpu")
    pads: list[int] = []
    packing = trainer.steps.packing

    def counted(lengths):
        out = packing(lengths)
        pads.extend(p for _, p in out)
        return out

    trainer.steps.packing = counted
    metrics = []
    for r in range(rollouts):
        samples = synthetic_samples(32, trainer.state.arch.vocab_size, seed=r, empty_every=7)
        if cfg.rollout.routing_replay:
            samples = with_routing(samples, trainer.state.arch, seed=r)
        steps = split_steps_and_ranks(samples, cfg.num_steps_per_rollout, cfg.train.data_parallel_size)[rank]
        metrics.append({k: v for k, v in trainer.train(r, steps).items() if k.startswith("train/")})
    weights = {
        name: t.detach().double().flatten().tolist()
        for name, t in iter_full_weights(trainer.state.module, trainer.state.arch)
    }
    trainer.shutdown()
    return {"metrics": metrics, "weights": weights, "pad_tokens": sum(pads), "micro_batches": len(pads)}
