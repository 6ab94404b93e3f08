"""The megatron-core trainer: one `Trainer` per rank (a Ray actor, see cluster.py), driven by `TrainerGroup`.

Per rollout step (`train`): recompute the log-probs of the rollout tokens with the current policy (the "old"
log-probs of PPO; their distance to vLLM's is `train/train_rollout_logprob_abs_diff`), then `num_steps_per_rollout`
optimizer steps, each over micro-batches packed by a token budget, gradients summed over data-parallel ranks and
clipped by the global norm computed across tensor- and expert-parallel ranks.

Optimizers: torch AdamW (every platform; the only one on CPU, where megatron's optimizer is CUDA-only) or
megatron-core's DistributedOptimizer (GPU). The LR is a pure function of the optimizer's step count, which is
saved with the optimizer, so a resume can never advance the schedule twice.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vime_core import algo
from vime_core.config import RunConfig
from vime_core.grads import megatron_grads_finite, sync_and_clip_grads
from vime_core.memory import train_step_memory
from vime_core.loss import (
    METRIC_KEYS, MicroBatch, NonFiniteStepError, check_finite_step, loss_scale, lr_at, micro_batch_loss, set_step_schedule,
    step_denominator, step_train_metrics,
)

log = logging.getLogger(__name__)


@dataclass
class TrainSample:
    """What the trainer needs of a rollout sample."""

    tokens: list[int]  # prompt + response
    prompt_len: int
    loss_mask: list[int]  # per response token
    rollout_logprobs: list[float]  # per response token
    advantage: float

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len


# --------------------------------------------------------------------------------------------------------------------
# batch arithmetic (driver side, pure)
# --------------------------------------------------------------------------------------------------------------------
def split_steps_and_ranks(samples: list[TrainSample], num_steps: int, dp: int) -> list[list[list[TrainSample]]]:
    """[dp_rank][optimizer_step] -> samples. Each step takes a contiguous slice of the rollout (whole groups when the
    global batch is a multiple of the group size); within a step, samples go to DP ranks balancing their tokens."""
    if len(samples) % num_steps:
        raise ValueError(f"{len(samples)} samples do not split into {num_steps} optimizer steps")
    per_step = len(samples) // num_steps
    out: list[list[list[TrainSample]]] = [[[] for _ in range(num_steps)] for _ in range(dp)]
    for step in range(num_steps):
        chunk = samples[step * per_step : (step + 1) * per_step]
        loads = [0] * dp
        counts = [0] * dp
        cap = per_step // dp  # every rank gets the same number of samples (sample_mean normalises by it)
        for s in sorted(chunk, key=lambda s: -len(s.tokens)):
            r = min((k for k in range(dp) if counts[k] < cap), key=lambda k: (loads[k], k))
            out[r][step].append(s)
            loads[r] += len(s.tokens)
            counts[r] += 1
    return out


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Token-budget packing: each micro-batch's summed length <= max_tokens (samples are packed into one row, no
    padding); a sample longer than the budget gets its own micro-batch. First fit over samples sorted longest first,
    so few micro-batches and each sample's place depends only on the lengths (deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        k = next((j for j, used in enumerate(loads) if used + n <= max_tokens), None)
        if k is None:
            batches.append([i])
            loads.append(n)
        else:
            batches[k].append(i)
            loads[k] += n
    return batches


# --------------------------------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------------------------------
class Trainer:
    """One trainer rank. Construct all ranks of a group concurrently: __init__ joins the process group."""

    def __init__(self, cfg: RunConfig, model_dir: str, rank: int, world_size: int, master_addr: str, master_port: int, platform: str,
                 init_checkpoint: str | None = None):
        from vime_core.platform import apply_megatron_compat, apply_megatron_cpu_shims, apply_offline_env

        apply_offline_env()
        apply_megatron_compat()
        self.cfg, self.rank, self.world_size, self.platform = cfg, rank, world_size, platform
        if platform == "cpu":
            apply_megatron_cpu_shims()
            torch.set_num_threads(cfg.train.cpu_threads or os.cpu_count() or 1)
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", 0)  # the actor sees exactly its own GPU (cluster._actor_env)
            torch.cuda.set_device(self.device)
        self._init_parallel(master_addr, master_port)
        self._build(model_dir, init_checkpoint)

    # -- setup --------------------------------------------------------------------------------------------------------
    def _init_parallel(self, master_addr: str, master_port: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from vime_core.platform import dist_backend

        t = self.cfg.train
        if not dist.is_initialized():
            from datetime import timedelta

            from vime_core.cluster import tcp_store

            timeout = timedelta(minutes=30)
            dist.init_process_group(
                dist_backend(self.platform),
                store=tcp_store(master_addr, master_port, self.rank, self.world_size, timeout),  # master_addr only
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
            )
        ps.initialize_model_parallel(
            tensor_model_parallel_size=t.tensor_parallel_size,
            pipeline_model_parallel_size=t.pipeline_parallel_size,
            expert_model_parallel_size=t.expert_parallel_size,
        )
        seed = self.cfg.seed + 100 * ps.get_pipeline_model_parallel_rank()
        torch.manual_seed(seed)
        if self.platform == "cpu":
            model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)  # dropout is 0: no RNG tracker needed
        else:
            model_parallel_cuda_manual_seed(seed)
        self.ps = ps

    def _build(self, model_dir: str, init_checkpoint: str | None) -> None:
        """Policy (and frozen reference) from the HF checkpoint, or the policy from a converted torch_dist one."""
        from vime_core import megatron_model as mm
        from vime_core.checkpoint import load_hf_state_dict, read_hf_config
        from vime_core.qwen3_mapping import arch_from_hf_config, hf_to_mcore

        t = self.cfg.train
        self.arch = arch_from_hf_config(read_hf_config(model_dir))
        self.tf_config = mm.transformer_config(
            self.arch, self.cfg.model.dtype, t.tensor_parallel_size, t.expert_parallel_size, t.sequence_parallel,
            on_cpu=self.platform == "cpu", recompute=mm.resolve_recompute(t.recompute, self.platform),
        )
        need_ref = self.cfg.grpo.kl_loss_coef > 0
        # a converted checkpoint replaces every policy weight: read the HF files only when something uses them
        full = hf_to_mcore(load_hf_state_dict(model_dir), self.arch) if need_ref or not init_checkpoint else None
        self.module = mm.build_gpt(self.arch, self.tf_config).to(self.device)  # the GPTModel itself
        if init_checkpoint:
            self._load_model(Path(init_checkpoint))
        else:
            mm.load_full_weights(self.module, full, self.arch)
        self.ref_model = None
        if need_ref:
            self.ref_model = mm.build_gpt(self.arch, self.tf_config).to(self.device).eval()
            mm.load_full_weights(self.ref_model, full, self.arch)
            self.ref_model.requires_grad_(False)
        del full
        self.optimizer = self._make_optimizer()
        self.step = 0  # optimizer steps taken; the LR schedule is a function of it
        self._init_memory()

    def _make_optimizer(self):
        """torch AdamW (params in cfg.model.dtype), or megatron-core's optimizer with fp32 main params and its
        DDP gradient buffers (`self.model` is then the DDP wrapper; `self.module` stays the GPTModel)."""
        t = self.cfg.train
        kind = t.optimizer
        if kind == "auto":
            kind = "adamw" if self.platform == "cpu" else "megatron"
        self.optimizer_kind = kind
        if kind == "megatron":
            if self.platform == "cpu":
                raise ValueError("train.optimizer = megatron needs a GPU (megatron-core's optimizer is CUDA-only); use adamw")
            from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            distributed = t.distributed_optimizer and t.data_parallel_size > 1
            self.model = DistributedDataParallel(
                self.tf_config,
                DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed),
                module=self.module,
            )
            return get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
                    adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
                    bf16=self.cfg.model.dtype == "bfloat16", params_dtype=self.tf_config.params_dtype,
                    use_distributed_optimizer=distributed,
                ),
                [self.model],
            )
        self.model = self.module
        decay, no_decay = [], []
        for p in self.module.parameters():
            (no_decay if p.ndim < 2 else decay).append(p)
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
        )

    def _zero_grad(self) -> None:
        if self.optimizer_kind == "megatron":
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _apply_step(self, lr: float, loss: float) -> float:
        """Reduce, clip and apply the accumulated gradients at learning rate `lr`; returns the global grad norm.
        A non-finite `loss` (the step's, equal on every rank) or gradient raises NonFiniteStepError on every rank
        before the optimizer touches the weights or its moments."""
        set_step_schedule(self.optimizer.param_groups, lr,
                          self.cfg.train.weight_decay if self.optimizer_kind == "megatron" else None)
        where = f"optimizer step {self.step}"
        if self.optimizer_kind == "megatron":
            from megatron.core.distributed import finalize_model_grads

            # DP all-reduce (or reduce-scatter), plus the TP sum of the q/k layer-norm gradients (see _sync_and_clip_grads)
            finalize_model_grads([self.model])
            # megatron's bf16/fp32 optimizer checks nothing (only fp16's loss scaler looks for inf): check the buffers
            check_finite_step(loss, None if self._all_ranks_ok(megatron_grads_finite(self.model)) else math.nan, where)
            ok, grad_norm, _ = self.optimizer.step()  # clips by the global norm itself
            if not ok:
                raise NonFiniteStepError(f"{where}: megatron's optimizer found non-finite gradients; the step was not applied")
            return float(grad_norm)
        grad_norm = self._sync_and_clip_grads()  # global over DP/TP/EP: the same value on every rank
        check_finite_step(loss, grad_norm, where)
        self.optimizer.step()
        return grad_norm

    def _all_ranks_ok(self, flag: bool) -> bool:
        """`flag` ANDed over every trainer rank (one tiny all-reduce), so that all ranks stop together."""
        t = torch.tensor([0.0 if flag else 1.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t) == 0.0

    # -- forward ------------------------------------------------------------------------------------------------------
    def _forward(self, model, batch: list[TrainSample], with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Log-probs (and entropy) of every response token of `batch`, concatenated; and each token's sample index.

        The samples are packed into one row (megatron's thd format: positions and attention restart per sample, see
        vime_core.attention); the log-probs come from the final hidden states chunk by chunk (vime_core.logprobs)."""
        from vime_core import megatron_model as mm
        from vime_core.attention import packed_seq_params
        from vime_core.logprobs import chunked_logprobs

        lens = [len(s.tokens) for s in batch]
        ids = torch.tensor([t for s in batch for t in s.tokens], dtype=torch.long).to(self.device)
        pos = torch.tensor([i for n in lens for i in range(n)], dtype=torch.long).to(self.device)
        gpt = mm.unwrap(model)
        with mm.hidden_states_only(gpt):
            hidden = model(input_ids=ids.unsqueeze(0), position_ids=pos.unsqueeze(0), attention_mask=None,
                           packed_seq_params=packed_seq_params(lens, self.device))  # [tokens, 1, h]
        # position t predicts token t+1: gather the positions that predict response tokens
        cols, sample_ids, start = [], [], 0
        for i, s in enumerate(batch):
            r = s.response_len
            cols += range(start + s.prompt_len - 1, start + s.prompt_len - 1 + r)
            sample_ids += [i] * r
            start += len(s.tokens)
        cols_t = torch.tensor(cols, dtype=torch.long).to(self.device)
        picked = hidden.squeeze(1).index_select(0, cols_t)
        # logits / temperature: vLLM's processed log-probs
        logp, ent = chunked_logprobs(picked, mm.output_weight(gpt), ids.index_select(0, cols_t + 1),
                                     self.cfg.rollout.temperature, with_entropy, self.cfg.train.logprob_chunk_tokens)
        return logp, ent, torch.tensor(sample_ids, device=self.device)

    @torch.no_grad()
    def _logprobs(self, model, samples: list[TrainSample]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(samples)
        with self.peaks.phase("logprobs"):
            for mb in pack_micro_batches([len(s.tokens) for s in samples], self.cfg.train.max_tokens_per_device):
                logp, _, sid = self._forward(model, [samples[i] for i in mb], with_entropy=False)
                for j, i in enumerate(mb):
                    out[i] = logp[sid == j].cpu()
        return out  # type: ignore[return-value]

    def _logprobs_of_live(self, model, samples: list[TrainSample]) -> list[torch.Tensor]:
        """`_logprobs` of the samples with response tokens; an empty tensor for the others (a micro-batch of empty
        responses alone has nothing to gather)."""
        live = [i for i, s in enumerate(samples) if s.response_len > 0]
        out = [torch.zeros(0) for _ in samples]
        for i, lp in zip(live, self._logprobs(model, [samples[i] for i in live]) if live else []):
            out[i] = lp
        return out

    # -- one rollout step ---------------------------------------------------------------------------------------------
    @train_step_memory
    def train(self, rollout_id: int, steps: list[list[TrainSample]]) -> dict[str, float]:
        """`steps[k]` are this rank's samples of optimizer step k. Returns metrics reduced over data-parallel ranks."""
        t0 = time.perf_counter()
        self.model.eval()
        flat = [s for step in steps for s in step]
        old = self._logprobs_of_live(self.model, flat)
        ref = self._logprobs_of_live(self.ref_model, flat) if self.ref_model is not None else None
        # |trainer - rollout| over the tokens the policy sampled (a custom generate masks out e.g. tool output)
        diffs = [
            (o - torch.tensor(s.rollout_logprobs)).abs()[torch.tensor(s.loss_mask, dtype=torch.bool)].mean().item()
            for s, o in zip(flat, old) if sum(s.loss_mask) and s.rollout_logprobs
        ]
        metrics: dict[str, float] = {"train/train_rollout_logprob_abs_diff": _mean(diffs)}
        self.model.train()
        offset = 0
        step_metrics = []
        for step_samples in steps:
            n = len(step_samples)
            step_metrics.append(self._optimizer_step(step_samples, old[offset : offset + n], ref[offset : offset + n] if ref else None))
            offset += n
        for k in step_metrics[0]:
            metrics[k] = _mean([m[k] for m in step_metrics])
        tokens = sum(len(s.tokens) for s in flat)
        metrics = self._reduce_over_dp(metrics)
        elapsed = time.perf_counter() - t0
        metrics["perf/actor_train_tok_per_s"] = self._sum_over_dp(tokens) / elapsed / max(1, self.world_size // self.cfg.train.data_parallel_size)
        return metrics

    def _optimizer_step(self, samples: list[TrainSample], old: list[torch.Tensor], ref: list[torch.Tensor] | None) -> dict[str, float]:
        g, dp = self.cfg.grpo, self.cfg.train.data_parallel_size
        trained = sum(sum(s.loss_mask) for s in samples)
        # the denominator of the loss is global over data-parallel ranks: samples, or trained (mask = 1) tokens
        step_tokens = int(self._sum_over_dp(trained)) if g.loss_aggregation == "token_mean" else 0
        denom = step_denominator(g.loss_aggregation, len(samples), step_tokens, dp)
        scale = loss_scale(self.optimizer_kind, dp)  # megatron's DDP averages over DP; the logged loss stays unscaled
        sums, loss_share = dict.fromkeys(METRIC_KEYS, 0.0), 0.0
        self._zero_grad()

        def flat(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device)

        # a sample without response tokens adds nothing to the loss (it still counts in sample_mean's denominator)
        live = [i for i, s in enumerate(samples) if s.response_len > 0]
        for mb in pack_micro_batches([len(samples[i].tokens) for i in live], self.cfg.train.max_tokens_per_device):
            idx = [live[j] for j in mb]
            batch = [samples[i] for i in idx]
            logp, ent, sid = self._forward(self.model, batch, with_entropy=True)
            loss, part = micro_batch_loss(MicroBatch(
                logp=logp, old_logp=torch.cat([old[i] for i in idx]).to(self.device),
                advantages=flat([s.advantage for s in batch for _ in range(s.response_len)]),
                mask=flat([m for s in batch for m in s.loss_mask]), sample_ids=sid, num_samples=len(batch), entropy=ent,
                ref_logp=torch.cat([ref[i] for i in idx]).to(self.device) if ref is not None else None,
                rollout_logp=flat([x for s in batch for x in s.rollout_logprobs]) if g.use_tis else None,
            ), g, denom)
            (loss * scale).backward()
            loss_share += float(loss.detach())
            for k in METRIC_KEYS:
                sums[k] += part[k]
        # step totals over DP ranks: exact token means, and the loss as the sum of the ranks' shares (a NaN on any
        # rank makes it NaN on all, so every rank stops together)
        *totals, all_trained, loss = self._sum_over_dp_many([*(sums[k] for k in METRIC_KEYS), trained, loss_share])
        lr = lr_at(self.step, self.cfg)
        grad_norm = self._apply_step(lr, loss)
        self.step += 1
        out = step_train_metrics(dict(zip(METRIC_KEYS, totals)), int(all_trained), loss, g)
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = lr
        return out

    def _sync_and_clip_grads(self) -> float:
        """Sum gradients over data-parallel ranks, compute the global norm (TP/EP-aware), clip. Returns the norm."""
        return sync_and_clip_grads(self.module, self.ps, self.cfg.train.clip_grad, self.device)

    def _reduce_over_dp(self, metrics: dict[str, float]) -> dict[str, float]:
        """Mean over data-parallel ranks (train/* are step totals already, equal on every rank: see _optimizer_step)."""
        dp = self.ps.get_data_parallel_world_size()
        if dp == 1:
            return metrics
        keys = sorted(metrics)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.ps.get_data_parallel_group())
        return dict(zip(keys, (t / dp).tolist()))

    def _sum_over_dp_many(self, values: list[float]) -> list[float]:
        if self.ps.get_data_parallel_world_size() == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.ps.get_data_parallel_group())
        return t.tolist()

    def _sum_over_dp(self, value: float) -> float:
        if self.ps.get_data_parallel_world_size() == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.ps.get_data_parallel_group())
        return float(t.item())

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def _load_model(self, path) -> None:
        from megatron.core import dist_checkpointing

        from vime_core.checkpoint import check_torch_dist_matches

        check_torch_dist_matches(path, self.module)
        state = dist_checkpointing.load(self.module.sharded_state_dict(), str(path))
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"torch_dist checkpoint {path}: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Model (torch_dist, collective), and this rank's optimizer state and RNG states, into `ckpt_dir`."""
        import random

        import numpy as np
        from megatron.core import dist_checkpointing

        d = Path(ckpt_dir)
        if self.rank == 0:
            for sub in ("model", "optimizer", "rng"):
                (d / sub).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self.module.sharded_state_dict(), str(d / "model"))
        name = f"rank_{self.rank:05d}.pt"
        if self.cfg.checkpoint.save_optimizer:
            torch.save({"optimizer": self.optimizer.state_dict(), "step": self.step}, d / "optimizer" / name)
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        torch.save(rng, d / "rng" / name)
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: str) -> int:
        """Restore model, optimizer (Adam moments and step count: the LR follows from it) and RNG. Returns the step."""
        import random

        import numpy as np

        d = Path(ckpt_dir)
        self._load_model(d / "model")
        name = f"rank_{self.rank:05d}.pt"
        opt_file = d / "optimizer" / name
        if opt_file.is_file():
            blob = torch.load(opt_file, map_location=self.device, weights_only=False)
            self.optimizer.load_state_dict(blob["optimizer"])
            self.step = int(blob["step"])
        rng = torch.load(d / "rng" / name, weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        return self.step

    # -- weights out --------------------------------------------------------------------------------------------------
    def export_hf_weights(self) -> list[tuple[str, torch.Tensor]] | None:
        """Full HF-named weights (CPU tensors) on global rank 0, None elsewhere. Collective over all ranks."""
        from vime_core.megatron_model import iter_full_weights
        from vime_core.qwen3_mapping import mcore_param_to_hf

        out = []
        for name, full in iter_full_weights(self.module, self.arch):
            if self.rank == 0:
                out += [(k, v.detach().to("cpu", copy=True).contiguous()) for k, v in mcore_param_to_hf(name, full, self.arch)]
        return out if self.rank == 0 else None

    # -- bucketed export for the GPU sync strategies (collective over trainer ranks, called in lockstep) ------------
    def begin_weight_export(self, bucket_bytes: int) -> None:
        from vime_core.megatron_model import DTYPES, iter_full_weights
        from vime_core.qwen3_mapping import mcore_param_to_hf

        dtype = DTYPES[self.cfg.model.engine_dtype]
        named = ((k, v.to(dtype)) for name, full in iter_full_weights(self.module, self.arch)
                 for k, v in mcore_param_to_hf(name, full, self.arch))
        from vime_core.sync import buckets

        self._export = buckets(named, bucket_bytes)
        self._bucket = None

    def _next_bucket(self):
        from vime_core.sync import pack_bucket

        self._bucket = None  # the engines loaded the previous one
        part = next(self._export, None)
        if part is None:
            return None
        self._bucket, layout = pack_bucket(part, self.device)
        return layout

    def next_ipc_bucket(self):
        """Pack the next bucket on this rank's GPU; -> (device UUID, CUDA IPC handle, layout) or None when done."""
        from torch.multiprocessing.reductions import reduce_tensor

        from vime_core.platform import current_device_uuid

        import pickle

        layout = self._next_bucket()
        if layout is None:
            return None
        torch.cuda.synchronize(self.device)
        # vLLM's msgpack channel to its engine core refuses the rebuild function inside a handle: send it pickled
        return current_device_uuid(self.platform), pickle.dumps(reduce_tensor(self._bucket)), layout

    def free_address(self) -> tuple[str, int]:
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def init_weight_group(self, address: str, port: int, world_size: int) -> None:
        """Rank 0 joins the NCCL group it shares with every engine worker (vLLM's stateless group)."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=address, port=port, rank=0, world_size=world_size)
        self._weight_comm = PyNcclCommunicator(group, device=self.device)

    def next_nccl_bucket(self):
        """Pack the next bucket; -> (layout, nbytes) or None. Rank 0 then broadcasts it (`broadcast_bucket`)."""
        layout = self._next_bucket()
        return None if layout is None else (layout, self._bucket.numel())

    def broadcast_bucket(self) -> None:
        self._weight_comm.broadcast(self._bucket, src=0, stream=torch.cuda.current_stream())
        torch.cuda.synchronize(self.device)

    def end_weight_export(self) -> None:
        self._export, self._bucket = None, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def weights_checksum(self) -> float:
        """Sum of |w| over this rank's parameters (tests use it to see that weights changed)."""
        return float(sum(p.detach().float().abs().sum() for p in self.module.parameters()))

    # -- colocated memory (vime_core.memory) -------------------------------------------------------------------------
    def _init_memory(self) -> None:
        from vime_core.memory import HostOffload, PhasePeaks, offload_enabled

        self.peaks = PhasePeaks(self.device)
        self.offloader = HostOffload(self.optimizer, self.model, self.module, self.device)
        self.offload_enabled = offload_enabled(self.cfg.train.offload_optimizer, self.cfg.cluster.colocate, self.platform)
        self.offload_times = {"offload": 0.0, "onload": 0.0}

    def offload_optimizer(self) -> bool:
        """Optimizer state and gradients to pinned host memory (vLLM generates next). False when not enabled."""
        if not self.offload_enabled:
            return False
        self.offload_times["offload"] = self.offloader.offload()
        self.peaks.record("offloaded", torch.cuda.memory_allocated(self.device) / 2**30)
        return True

    def onload_optimizer(self) -> bool:
        """Back on the device before training. False when not enabled."""
        if not self.offload_enabled:
            return False
        self.offload_times["onload"] = self.offloader.onload()
        return True

    def info(self) -> dict[str, Any]:
        from vime_core.platform import max_rss_gib

        cuda = self.device.type == "cuda"
        return {
            "rank": self.rank,
            "params": sum(p.numel() for p in self.module.parameters()),
            "step": self.step,
            "device": str(self.device),
            "max_rss_gib": max_rss_gib(),
            "max_gpu_mem_gib": max([torch.cuda.max_memory_allocated(self.device) / 2**30, *self.peaks.max.values()]) if cuda else 0.0,
            "gpu_peak_gib_by_phase": dict(self.peaks.max),  # logprobs, train (whole step), offloaded (held meanwhile)
            "host_offload_gib": self.offloader.host_bytes() / 2**30,
        }

    def shutdown(self) -> None:
        if dist.is_initialized():
            self.ps.destroy_model_parallel()
            dist.destroy_process_group()


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


# --------------------------------------------------------------------------------------------------------------------
# driver side
# --------------------------------------------------------------------------------------------------------------------
def make_train_batch(groups: list, cfg: RunConfig) -> tuple[list[TrainSample], dict[str, float]]:
    """Scored groups -> trainer samples with GRPO advantages (group-normalised rewards broadcast to every token)."""
    n = cfg.rollout.n_samples_per_prompt
    samples = [s for g in groups for s in g]
    if any(len(g) != n for g in groups):
        raise ValueError(f"every group must hold rollout.n_samples_per_prompt = {n} samples")
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    if not torch.isfinite(rewards).all():  # RewardModel refuses these already; a NaN here would reach every weight
        bad = int((~torch.isfinite(rewards)).nonzero()[0])
        raise ValueError(f"sample {bad % n} of group {bad // n} has a non-finite reward {samples[bad].reward}")
    adv = algo.group_advantages(rewards, n, cfg.grpo.normalize_std)
    batch = [
        TrainSample(
            tokens=list(s.prompt_ids) + list(s.response_ids),
            prompt_len=len(s.prompt_ids),
            loss_mask=list(s.mask),
            rollout_logprobs=list(s.rollout_logprobs),
            advantage=float(a),
        )
        for s, a in zip(samples, adv.tolist())
    ]
    return batch, {"rollout/rewards": float(adv.mean()), "rollout/advantage_abs_mean": float(adv.abs().mean())}


class TrainerGroup:
    """The trainer ranks (Ray actors) seen as one trainer by the loop."""

    def __init__(self, actors: list, cfg: RunConfig):
        self.actors, self.cfg = actors, cfg

    def call_all(self, method: str, *args, timeout_s: float | None = None, setting: str = "train.timeout_s") -> list:
        """`method` on every rank; one that does not answer within `timeout_s` (default train.timeout_s) raises
        naming the rank, the method and the `setting` that bounds it."""
        from vime_core.cluster import gather

        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return gather(refs, [f"trainer rank {i}" for i in range(len(refs))], method,
                      timeout_s or self.cfg.train.timeout_s, setting if timeout_s else "train.timeout_s")

    def train(self, rollout_id: int, groups: list) -> dict[str, float]:
        from vime_core.cluster import gather

        t = self.cfg.train
        samples, metrics = make_train_batch(groups, self.cfg)
        per_dp = split_steps_and_ranks(samples, self.cfg.num_steps_per_rollout, t.data_parallel_size)
        # megatron's rank order is tp-cp-ep-dp-pp: ranks of one TP group are consecutive
        futures = [a.train.remote(rollout_id, per_dp[rank // t.tensor_parallel_size % t.data_parallel_size])
                   for rank, a in enumerate(self.actors)]
        done = gather(futures, [f"trainer rank {i}" for i in range(len(futures))], f"train (rollout {rollout_id})",
                      t.timeout_s, "train.timeout_s")
        return {**metrics, **done[0]}

    def export_hf_weights(self) -> list:
        return self.call_all("export_hf_weights")[0]

    def weights_checksum(self) -> float:
        return sum(self.call_all("weights_checksum"))

    def save_checkpoint(self, ckpt_dir: str) -> None:
        self.call_all("save_checkpoint", ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> int:
        return self.call_all("load_checkpoint", ckpt_dir)[0]

    def info(self) -> list[dict]:
        return self.call_all("info")

    def offload_optimizer(self) -> None:
        """Colocated GPUs (train.offload_optimizer): optimizer state to host memory while vLLM generates."""
        if getattr(self, "_offload", True):
            self._offload = all(self.call_all("offload_optimizer"))

    def onload_optimizer(self) -> None:
        if getattr(self, "_offload", True):
            self._offload = all(self.call_all("onload_optimizer"))

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception:  # the actor may already be gone; ray.shutdown cleans up
                pass
