"""One trainer rank, the Ray actor (`Trainer`, created by cluster.create_trainers, driven by `TrainerGroup`): its setup
(process group, megatron's parallel state, the model build into a `RankState`), and the collaborators it owns, each
built from that state: the step runner (`StepRunner`, vime_core.trainer.step), the rank checkpoint (`RankCheckpoint`,
checkpoint_io) and the weight exporter of the run's transport (vime_core/sync/, behind the one door `weights`); then
colocated memory and its info.

Optimizers (vime_core.trainer.optim): torch AdamW (every platform; the only one on CPU, where megatron's optimizer is
CUDA-only) or megatron-core's DistributedOptimizer (GPU). The LR is a pure function of the optimizer's step count,
which is saved with the optimizer, so a resume can never advance the schedule twice.
"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from vime_core.config import RunConfig
from vime_core.progress import Heartbeat
from vime_core.platform import cpu_threads, ray_node_id
from vime_core.sync.base import WeightSource
from vime_core.trainer.checkpoint_io import RankCheckpoint
from vime_core.trainer.optim import make_optimizer
from vime_core.trainer.state import RankState
from vime_core.trainer.step import StepRunner

CHECKSUM_SLICE = 1 << 24  # elements summed at a time by `Trainer.checksum` (128 MiB as float64)


class Trainer:
    """One trainer rank. Construct all ranks of a group concurrently: __init__ joins the process group and builds
    the model, or with `defer_start` only imports, and `start()` (on every rank at once) does the rest: on colocated
    GPUs the loop calls it once the vLLM engines have sized their KV caches (see rpc.wait_ready)."""

    def __init__(
        self,
        cfg: RunConfig,
        model_dir: str,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        platform: str,
        init_checkpoint: str | None = None,
        defer_start: bool = False,
    ):
        from vime_core.platform import apply_megatron_compat, apply_offline_env

        apply_offline_env()
        apply_megatron_compat()  # imports megatron: with defer_start, this overlaps the engines' start
        self.cfg, self.rank, self.world_size, self.platform = cfg, rank, world_size, platform
        self.heartbeat = Heartbeat(f"trainer rank {rank}")  # the name TrainerGroup's calls give this rank
        self._pending: tuple | None = (model_dir, master_addr, master_port, init_checkpoint)
        self.state: RankState | None = None  # the built rank (`start`), which every collaborator below reads
        self.steps: StepRunner | None = None
        self.checkpoint: RankCheckpoint | None = None
        self.exporter = None  # this rank's half of the weight transport, made on the first push (`weights`)
        if not defer_start:
            self.start()

    def start(self) -> dict[str, Any]:
        """Join the process group, build the model and the optimizer (once; later calls only answer); returns info()."""
        if self._pending is not None:
            model_dir, master_addr, master_port, init_checkpoint = self._pending
            self._setup_device()
            self._init_parallel(master_addr, master_port)
            self._build(model_dir, init_checkpoint)
            self._pending = None
        return self.info()

    def _setup_device(self) -> None:
        from vime_core.platform import apply_megatron_cpu_shims

        cfg, platform, world_size = self.cfg, self.platform, self.world_size
        if platform == "cpu":
            apply_megatron_cpu_shims()
            torch.set_num_threads(
                cpu_threads(
                    os.cpu_count() or 1,
                    cfg.rollout.max_staleness,
                    "train",
                    world_size,
                    cfg.rollout.num_engines,
                    cfg.train.cpu_threads,
                )
            )
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", 0)  # the actor sees exactly its own GPU (cluster._actor_env)
            torch.cuda.set_device(self.device)
            if cfg.train.optimizer_cpu_offload:
                # the host-side Adam step is the only CPU work while vLLM sleeps; Ray leaves the actor 1 thread
                torch.set_num_threads(cfg.train.cpu_threads or max(1, (os.cpu_count() or 1) // world_size))

    # -- setup --------------------------------------------------------------------------------------------------------
    def _init_parallel(self, master_addr: str, master_port: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from vime_core.platform import dist_backend

        t = self.cfg.train
        if not dist.is_initialized():
            from vime_core.ports import tcp_store

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
        """Policy (and frozen reference) from the HF checkpoint, or the policy from a converted torch_dist one; then
        the optimizer, the `RankState` and the collaborators made from it."""
        from vime_core import megatron_model as mm
        from vime_core.checkpoint import load_hf_state_dict, load_torch_dist, read_hf_config
        from vime_core.memory import PhasePeaks, resolve_recompute
        from vime_core.models import arch_from_hf_config, resolve_grouped_gemm, spec_of

        t, device = self.cfg.train, self.device
        arch = arch_from_hf_config(read_hf_config(model_dir))
        tf_config = mm.transformer_config(
            arch,
            self.cfg.model.dtype,
            t.tensor_parallel_size,
            t.expert_parallel_size,
            t.sequence_parallel,
            on_cpu=self.platform == "cpu",
            recompute=resolve_recompute(t.recompute, self.platform),
            grouped_gemm=resolve_grouped_gemm(t.moe_grouped_gemm, arch, self.cfg.model.dtype, t.tensor_parallel_size),
            routing_replay=self.cfg.rollout.routing_replay,
            dispatcher=t.moe_token_dispatcher,
        )
        need_ref = self.cfg.grpo.kl_loss_coef > 0
        # a converted checkpoint replaces every policy weight: read the HF files only when something uses them
        to_mcore = spec_of(arch).mapping().hf_to_mcore
        full = to_mcore(load_hf_state_dict(model_dir), arch) if need_ref or not init_checkpoint else None
        module = mm.build_gpt(arch, tf_config).to(device)  # the GPTModel itself
        if init_checkpoint:
            load_torch_dist(module, Path(init_checkpoint))
        else:
            mm.load_full_weights(module, full, arch)
        ref_model = None
        if need_ref:
            ref_model = mm.build_gpt(arch, tf_config).to(device).eval()
            mm.load_full_weights(ref_model, full, arch)
            ref_model.requires_grad_(False)
        del full
        optim = make_optimizer(self.cfg, self.platform, module, tf_config, self.ps, device)
        self.state = RankState(
            self.cfg,
            self.rank,
            self.world_size,
            self.platform,
            device,
            self.ps,
            arch,
            module,
            ref_model,
            optim,
            PhasePeaks(device),
            self.heartbeat,
        )
        self.steps, self.checkpoint = StepRunner(self.state), RankCheckpoint(self.state)
        self._init_memory()

    # -- the collaborators' doors -------------------------------------------------------------------------------------
    def train(self, rollout_id: int, steps: list) -> dict[str, float]:
        """One rollout step (`StepRunner.train`); its metrics."""
        return self.steps.train(rollout_id, steps)

    def save_checkpoint(self, ckpt_dir: str) -> None:
        self.checkpoint.save_checkpoint(ckpt_dir)

    def load_checkpoint(self, ckpt_dir: str) -> int:
        return self.checkpoint.load_checkpoint(ckpt_dir)

    # -- weights out: this rank's half of the run's weight transport (vime_core/sync/) ----------------------------------
    def _full_weights(self) -> tuple[Iterator[tuple[str, torch.Tensor]], Callable]:
        """(megatron name, full tensor) of every parameter (a collective walk), and the megatron -> HF mapping."""
        from vime_core.megatron_model import iter_full_weights
        from vime_core.models import spec_of

        st = self.state
        return iter_full_weights(st.module, st.arch), partial(
            spec_of(st.arch).mapping().mcore_param_to_hf, arch=st.arch
        )

    def weights(self, op: str, *args):
        """The trainer's one door for weights: runs `op` of this run's transport exporter (vime_core/sync/<transport>:
        `export`, or `begin` / `next` / `end` and NCCL's `free_address` / `join` / `broadcast`); collective over the
        trainer ranks, which the push calls in lockstep."""
        if self.exporter is None:
            from vime_core.megatron_model import DTYPES
            from vime_core.sync import resolve_strategy, transport_class

            c = self.cfg
            strategy = resolve_strategy(c.sync.strategy, self.platform, c.cluster.colocate)  # as the loop's WeightSync
            source = WeightSource(
                self._full_weights, self.rank, self.device, self.platform, DTYPES[c.model.engine_dtype]
            )
            self.exporter = transport_class(strategy).exporter(source)
        return self.exporter.call(op, *args)

    def checksum(self) -> float:
        """Sum of |w| over this rank's parameters (tests use it to see that weights changed), accumulated in float64
        a slice at a time: a float32 sum of the tiny model's ~16,700 rounds at ~2e-3, as much as a short run can
        move it, and a float64 copy of an 8B embedding at once would take 4.6 GiB."""
        total = 0.0
        for p in self.state.module.parameters():
            for part in p.detach().reshape(-1).split(CHECKSUM_SLICE):
                total += float(part.abs().sum(dtype=torch.float64))
        return total

    # -- colocated memory (vime_core.memory) -------------------------------------------------------------------------
    def _init_memory(self) -> None:
        from vime_core.memory import HostOffload, offload_enabled

        st = self.state
        self.offloader = HostOffload(st.optimizer, st.model, st.module, self.device)
        self.offload_enabled = offload_enabled(
            self.cfg.train.offload_optimizer, self.cfg.cluster.sleeping_engines, self.platform
        )
        if self.offload_enabled and self.device.type == "cuda":
            self.offloader.start_prepinning()

    def offload_optimizer(self) -> dict[str, float] | None:
        """Optimizer state and gradients to pinned host memory (vLLM generates next): its time and what stays on the
        device (the bf16 weights: 3.3 GiB for Qwen3-1.7B on an H200), for the metrics of the step that trained just
        before. None when not enabled."""
        if not self.offload_enabled:
            return None
        from vime_core.platform import rss_gib

        off = self.offloader
        seconds = off.offload()
        resident = torch.cuda.memory_allocated(self.device) / 2**30
        self.state.peaks.record("offloaded", resident)
        return {
            "perf/optimizer_offload_time": seconds,
            "perf/trainer_resident_after_offload_gib": resident,
            # host side: what the offload holds pinned, how much of it the pre-pinning's forecast missed, and the
            # trainer's whole resident memory
            "perf/host_offload_gib": off.host_bytes() / 2**30,
            "perf/offload_unforeseen_gib": off.unforeseen_bytes() / 2**30,
            "perf/trainer_host_rss_gib": rss_gib(),
        }

    def onload_optimizer(self) -> bool:
        """Back on the device before training. False when not enabled."""
        if not self.offload_enabled:
            return False
        self.state.onload_time = self.offloader.onload()
        return True

    def info(self) -> dict[str, Any]:
        from vime_core.platform import max_rss_gib

        cuda, st = self.device.type == "cuda", self.state
        return {
            "rank": self.rank,
            "params": sum(p.numel() for p in st.module.parameters()),
            "step": st.step,
            "device": str(self.device),
            "max_rss_gib": max_rss_gib(),
            "max_gpu_mem_gib": max([torch.cuda.max_memory_allocated(self.device) / 2**30, *st.peaks.max.values()])
            if cuda
            else 0.0,
            "gpu_peak_gib_by_phase": dict(st.peaks.max),  # logprobs, train (whole step), offloaded (held meanwhile)
            "host_offload_gib": self.offloader.host_bytes() / 2**30,
            "node_id": ray_node_id(),  # which Ray node the rank runs on (tests of multi-node placement ask Ray)
        }

    def shutdown(self) -> None:
        if dist.is_initialized():
            self.ps.destroy_model_parallel()
            dist.destroy_process_group()
