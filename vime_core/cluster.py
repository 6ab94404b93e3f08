"""Ray: start or join a cluster, place trainer and engine bundles, create the actor groups.

Local by default (127.0.0.1, no dashboard, offline variables); `cluster.ray_address` or `RAY_ADDRESS` joins an
existing cluster (e.g. the KubeRay one in infra/). One placement group holds a bundle per device:
- colocated: bundle i is shared by trainer rank i and engine i (fractional GPUs), so they sit on the same device;
- disaggregated: trainer bundles first, then engine bundles, packed.
On CPU the "devices" are processes: one bundle of one logical CPU per trainer rank and per engine.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_core.config import RunConfig
from vime_core.platform import LOCAL_RAY_ENV, apply_offline_env, raise_fd_limit, worker_env

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 180


class ClusterError(RuntimeError):
    """Ray could not give us what the config asks for; the message says what was missing."""


def init_ray(cfg: RunConfig, platform: str) -> None:
    import ray

    if ray.is_initialized():
        return
    apply_offline_env()
    _write_ray_bootstrap_config()
    raise_fd_limit(gpu=platform != "cpu")
    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {k: v for k, v in worker_env(platform, None).items() if k != "CUDA_VISIBLE_DEVICES"}}
    if address:
        log.info("joining Ray cluster at %s", address)
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return
    cpus = cfg.cluster.num_cpus or max(4, os.cpu_count() or 1)
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    ray.init(
        num_cpus=cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env=env,
        log_to_driver=True,
        configure_logging=False,
    )


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _write_ray_bootstrap_config() -> None:
    """A local-provider bootstrap config stops Ray probing cloud metadata addresses at start (no network here)."""
    path = Path.home() / "ray_bootstrap_config.yaml"
    if not path.exists():
        try:
            path.write_text("provider:\n  type: local\n")
        except OSError:
            pass


@dataclass
class Placement:
    pg: Any
    trainer_bundles: list[int]  # bundle of each trainer rank
    engine_bundles: list[list[int]]  # bundles of each engine (engine_tensor_parallel_size of them)
    gpu: bool
    colocate: bool
    bundle_devices: list[str]  # the GPU id Ray gave each bundle ("" on CPU)

    @property
    def engines_sleep(self) -> bool:
        """Colocated GPU engines release their memory while the trainer works (vLLM sleep mode)."""
        return self.colocate and self.gpu

    def devices(self, bundles: list[int]) -> list[int]:
        return [int(self.bundle_devices[b]) for b in bundles] if self.gpu else []


def make_placement(cfg: RunConfig, platform: str, engines_only: bool = False) -> Placement:
    """One bundle per device (see module doc); `engines_only` for evaluation without a trainer."""
    import ray
    from ray.util.placement_group import placement_group

    gpu = platform != "cpu"
    n_train, n_roll = (0 if engines_only else cfg.train.num_devices), cfg.rollout_devices
    tp = cfg.rollout.engine_tensor_parallel_size
    unit = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
    colocate = cfg.cluster.colocate and not engines_only
    first_engine_bundle = 0 if colocate else n_train
    bundles = [dict(unit) for _ in range(n_train if colocate else n_train + n_roll)]
    engine_b = [list(range(first_engine_bundle + e * tp, first_engine_bundle + (e + 1) * tp)) for e in range(cfg.rollout.num_engines)]
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        raise ClusterError(
            f"Ray could not place {len(bundles)} bundle(s) of {unit} within {PLACEMENT_TIMEOUT_S}s; "
            f"cluster resources: {ray.cluster_resources()}. Lower train.num_devices / rollout.num_engines or add nodes."
        )
    p = Placement(pg, list(range(n_train)), engine_b, gpu, colocate, [""] * len(bundles))
    if gpu:
        p.bundle_devices = _bundle_gpus(p, len(bundles))
    return p


def _bundle_gpus(p: Placement, n: int) -> list[str]:
    """Which GPU each bundle holds, asked of a tiny task placed in it: actors get that id as their visible device
    (Ray is told not to rewrite visibility), which also lets an engine span the GPUs of several bundles."""
    import ray

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def gpu_id() -> str:
        return str(ray.get_gpu_ids()[0])

    return ray.get([gpu_id.options(scheduling_strategy=_strategy(p, b)).remote() for b in range(n)])


def _strategy(p: Placement, bundle: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=p.pg, placement_group_bundle_index=bundle)


def _actor_env(platform: str, device_ids: list[int]) -> dict[str, str]:
    env = worker_env(platform, device_ids)  # visible devices + Ray's NOSET variables + offline variables
    # megatron, vLLM and torch warn on every import about optional packages absent here; keep actor logs readable
    env.setdefault("PYTHONWARNINGS", os.environ.get("VIME_ACTOR_WARNINGS", "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning"))
    if platform == "cpu":
        # Ray sets OMP_NUM_THREADS=1 for 1-CPU actors; trainer and engines take turns, so each may use every core
        env["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    return env


def _share(p: Placement) -> float:
    """GPU fraction per actor (Ray's accounting): whole devices when disaggregated, shared when colocated."""
    return (0.45 if p.colocate else 1.0) if p.gpu else 0.0


def create_engines(cfg: RunConfig, p: Placement, platform: str, model_path: str) -> list[Any]:
    """Engine actors; they start in the background (see `wait_ready`)."""
    import ray

    from vime_core.rollout import EngineOptions, VLLMEngine

    max_len = cfg.data.max_prompt_len + max(cfg.rollout.max_response_len, cfg.eval.max_response_len or 0)
    engines = []
    for i, bundles in enumerate(p.engine_bundles):
        opts = EngineOptions(
            model_path=model_path,
            dtype=cfg.model.engine_dtype,
            max_model_len=max_len,
            seed=cfg.seed + i,
            platform=platform,
            tensor_parallel_size=cfg.rollout.engine_tensor_parallel_size,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            cpu_kv_cache_gib=cfg.rollout.cpu_kv_cache_gib,
            enforce_eager=cfg.rollout.enforce_eager,
            custom_generate=cfg.rollout.custom_generate,
            sleep_mode=p.engines_sleep,
        )
        actor = ray.remote(VLLMEngine).options(
            num_cpus=0 if p.colocate else 1,
            num_gpus=_share(p),
            scheduling_strategy=_strategy(p, bundles[0]),
            runtime_env={"env_vars": _actor_env(platform, p.devices(bundles))},
        ).remote(opts)
        engines.append(actor)
    return engines


def master_address(p: Placement, bundle: int) -> tuple[str, int]:
    """IP and a free port on the node of `bundle` (where trainer rank 0 runs), found by a task placed there."""
    import ray

    @ray.remote(num_cpus=0, num_gpus=0)
    def probe() -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    return ray.get(probe.options(scheduling_strategy=_strategy(p, bundle)).remote())


def create_trainers(cfg: RunConfig, p: Placement, platform: str, model_dir: str, init_checkpoint: str | None = None) -> list[Any]:
    """All trainer ranks, constructed concurrently (each joins the process group in __init__); they start in the
    background (see `wait_ready`)."""
    import ray

    from vime_core.train import Trainer

    addr, port = master_address(p, p.trainer_bundles[0])
    world = len(p.trainer_bundles)
    actors = [
        ray.remote(Trainer).options(
            num_cpus=1,
            num_gpus=_share(p),
            scheduling_strategy=_strategy(p, bundle),
            runtime_env={"env_vars": _actor_env(platform, p.devices([bundle]))},
        ).remote(cfg, model_dir, rank, world, addr, port, platform, init_checkpoint)
        for rank, bundle in enumerate(p.trainer_bundles)
    ]
    return actors


def wait_ready(trainers: list[Any], engines: list[Any]) -> None:
    """Wait for trainers and engines together (they start concurrently); a failure names the actor that failed."""
    import ray

    pending = {a.info.remote(): f"trainer rank {i}" for i, a in enumerate(trainers)}
    pending |= {e.ready.remote(): f"vLLM engine {i}" for i, e in enumerate(engines)}
    for ref, who in pending.items():
        try:
            ray.get(ref)
        except Exception as e:
            raise ClusterError(f"{who} failed to start: {e}") from e
