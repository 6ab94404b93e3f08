"""Ray: start or join a cluster, place trainer and engine bundles, create the actor groups.

Local by default (127.0.0.1, no dashboard, offline variables); `cluster.ray_address` or `RAY_ADDRESS` joins an
existing cluster (e.g. the KubeRay one in infra/). One placement group holds a bundle per device: colocated, bundle
i is shared by trainer rank i and engine i (fractional GPUs, the same device); disaggregated, trainers' then engines'.
On CPU the "devices" are processes: one bundle of one logical CPU per trainer rank and per engine.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_core.config import RunConfig
from vime_core.errors import ClusterError
from vime_core.orphans import remove_on_death
from vime_core.platform import LOCAL_RAY_ENV, apply_offline_env, raise_fd_limit, worker_env
from vime_core.ports import free_port
from vime_core.rpc import gather

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 180


# A local run exposes nothing beyond 127.0.0.1. Ray 2.60 reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when it is
# imported: with it at 0 the node IP is 127.0.0.1 and gcs, raylet, workers, agents and monitor listen there only;
# without it `_node_ip_address="127.0.0.1"` is resolved back to eth0 and most of them listen on every interface
# (measured with `ss -ltnp`: 16 sockets on `*`, 0.0.0.0 or eth0 before, none after). vLLM's distributed init uses
# VLLM_HOST_IP; gloo and NCCL pick their interface by name. Never set in a process that joins a cluster.
LOOPBACK_ENV = {
    **LOCAL_RAY_ENV,
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}


@dataclass
class _LocalRay:
    """What a local Ray of this process left on disk, removed by `shutdown_ray`."""

    session_dir: Path | None = None
    preexisting: frozenset[int] = frozenset()  # our children before ray.init (e.g. vime-pipeline's Prefect server)
    tmp_dir: Path | None = None  # the actors' TMPDIR (vLLM's vllm_dist_* stores, multiprocessing's pymp-* dirs)
    env_set: tuple[str, ...] = ()


_local = _LocalRay()


# A vime_core.early_ray.EarlyStart while `vime train` / `vime-pipeline` start Ray and actors in a background thread:
# init_ray waits for it, make_placement / create_trainers / create_engines take what it prestarted when it was made
# from the same inputs (early_ray.EarlyStart.key).
early_start: Any = None


def init_ray(cfg: RunConfig, platform: str) -> None:
    main = threading.current_thread() is threading.main_thread()
    ours = signal.getsignal(signal.SIGTERM) if main else None
    if early_start is None or not early_start.wait():  # not started in the background (else: raises its error)
        init_ray_now(cfg, platform)
    if main:
        keep_sigterm(ours)


def keep_sigterm(ours: Any) -> None:
    """ray.init in the main thread replaces SIGTERM's handler with one calling sys.exit (the run would exit 15, not
    through `vime train`'s cleanup). Put back the Python handler set before (`vime train`'s, or Prefect's in a flow
    run, whose cancellation checks that it is installed), or else keep Ray's. (Ray's core worker also puts abseil's
    crash handler on SIGTERM at the C level, over Python's: init_ray_now turns that off for this process.)"""
    if callable(ours):  # else (SIG_DFL, SIG_IGN, none from Python) Ray's stays: exit through atexit's ray.shutdown
        signal.signal(signal.SIGTERM, ours)


def init_ray_now(cfg: RunConfig, platform: str) -> None:
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return
    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if not address:
        _local.env_set = tuple(k for k in LOOPBACK_ENV if k not in os.environ)
        os.environ.update({k: LOOPBACK_ENV[k] for k in _local.env_set})  # before `import ray`: see LOOPBACK_ENV
    import ray
    from ray._private import ray_constants  # read at ray.init; its environment variable would reach the actors too

    # Abseil's failure-signal handler (Ray's core worker installs it) takes SIGTERM too: it passes the signal on and
    # arms a 3 s SIGALRM that aborts the process, so a cleanup longer than that died by SIGABRT, not exit 143. Off in
    # the driver only (Python's faulthandler, which Ray enables, still reports its crashes); the actors keep it.
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    apply_offline_env()
    _write_ray_bootstrap_config()
    raise_fd_limit(gpu=platform != "cpu")
    env = {"env_vars": {k: v for k, v in worker_env(platform, None).items() if k != "CUDA_VISIBLE_DEVICES"}}
    if address:
        log.info("joining Ray cluster at %s", address)
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return
    _loopback_node_ip()
    cpus = local_cpus(cfg)
    _local.tmp_dir = _actors_tmp_dir()
    _local.preexisting = frozenset(p.pid for p in _descendants())
    ctx = ray.init(
        num_cpus=cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env=env,
        log_to_driver=True,
        configure_logging=False,
    )
    _local.session_dir = Path(ctx.address_info["session_dir"])
    if os.environ.get("VIME_KEEP_RAY_SESSION", "") in ("", "0"):
        remove_on_death(_local.session_dir)
    remove_on_death(_local.tmp_dir)  # a SIGKILLed run cannot call shutdown_ray: its watchdog removes them


def _loopback_node_ip() -> None:
    """Ray was imported before init_ray set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (a test, a flow importing it early):
    its import-time constant says 'cluster', which resolves 127.0.0.1 to eth0. Correct the constant."""
    from ray._private import ray_constants  # Ray has no public switch for this

    ray_constants.ENABLE_RAY_CLUSTER = False


def local_cpus(cfg: RunConfig) -> int:
    return cfg.cluster.num_cpus or max(4, os.cpu_count() or 1)


def shutdown_ray() -> None:
    """Stop Ray; for a local one also remove its session dir under /tmp/ray (logs: set VIME_KEEP_RAY_SESSION=1 to
    keep them) and the actors' temporary dir, and restore the loopback variables."""
    global early_start
    early, early_start = early_start, None
    if early is not None:  # started in the background: let it finish starting before stopping it
        early.started.wait()
    import ray

    ray_procs = _ray_descendants() if _local.session_dir else []
    if ray.is_initialized():
        ray.shutdown()
    if early is not None:
        early.release.set()
    if ray_procs:  # they still write logs and sockets for a moment after ray.shutdown() returns
        import psutil

        _, left = psutil.wait_procs(ray_procs, timeout=10)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
    keep = os.environ.get("VIME_KEEP_RAY_SESSION", "") not in ("", "0")
    for path in (_local.tmp_dir, None if keep else _local.session_dir):
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
    latest = Path(_local.session_dir or "/nonexistent").parent / "session_latest"
    if not keep and latest.is_symlink() and not latest.exists():
        latest.unlink(missing_ok=True)
    for k in _local.env_set:
        os.environ.pop(k, None)
    _local.session_dir = _local.tmp_dir = None
    _local.env_set, _local.preexisting = (), frozenset()


def _descendants() -> list:
    try:
        import psutil

        return psutil.Process().children(recursive=True)
    except Exception:  # psutil missing or the process tree changed under us
        return []


def _ray_descendants() -> list:
    """A local Ray's processes: the children started since ray.init that run Ray's own programs (gcs_server, raylet,
    dashboard, monitors: all files of the ray package) and every descendant of those (agents, workers, actors and
    their helpers). Other children are not Ray's to stop: the orphan watchdog, vime-pipeline's temporary Prefect
    server (killing it made the train task loop on `Connection refused`), and the math-verify workers, which
    started after ray.init but do not exit with Ray: waiting for them cost 10 of the 47 s of `vime train`."""
    import ray

    from vime_core.orphans import watchdog_pid

    skip = _local.preexisting | {watchdog_pid()}
    ray_dir = os.path.dirname(ray.__file__)
    out = []
    try:
        import psutil

        for child in psutil.Process().children():
            try:
                if child.pid in skip or not any(ray_dir in arg for arg in child.cmdline()):
                    continue
                out += [child, *child.children(recursive=True)]
            except psutil.Error:  # gone meanwhile
                continue
    except Exception:  # psutil missing
        return []
    return out


def _write_ray_bootstrap_config() -> None:
    """A local-provider bootstrap config stops Ray probing cloud metadata addresses at start (no network here)."""
    path = Path.home() / "ray_bootstrap_config.yaml"
    if not path.exists():
        with contextlib.suppress(OSError):
            path.write_text("provider:\n  type: local\n")


@dataclass
class Placement:
    pg: Any
    trainer_bundles: list[int]  # bundle of each trainer rank
    engine_bundles: list[list[int]]  # bundles of each engine (engine_tensor_parallel_size of them)
    gpu: bool
    colocate: bool
    bundle_devices: list[str]  # the GPU id Ray gave each bundle ("" on CPU)
    sleep: bool = True  # cluster.engines_sleep

    @property
    def colocated_gpu(self) -> bool:
        """Trainers and engines share GPUs: the engines start first (`wait_ready`), the trainers' GPU work after."""
        return self.colocate and self.gpu

    @property
    def engines_sleep(self) -> bool:
        """Colocated GPU engines release their memory while the trainer works (vLLM sleep mode; cluster.engines_sleep)."""
        return self.colocated_gpu and self.sleep

    def devices(self, bundles: list[int]) -> list[int]:
        return [int(self.bundle_devices[b]) for b in bundles] if self.gpu else []


def placement_problem(
    cfg: RunConfig, platform: str, have_cpus: float, have_gpus: float, engines_only: bool = False
) -> str | None:
    """Why the bundles of `cfg` cannot fit into `have_cpus` / `have_gpus`, or None: one bundle of one device (GPU, or
    a logical CPU on the CPU platform) per trainer rank, and per engine device unless colocated."""
    n_train = 0 if engines_only else cfg.train.num_devices
    colocate = cfg.cluster.colocate and not engines_only
    need = n_train if colocate else n_train + cfg.rollout_devices
    what = (
        f"train.num_devices = {n_train}"
        + ("" if colocate else f" + rollout.num_engines x engine_tensor_parallel_size = {cfg.rollout_devices}")
        + (" (colocated)" if colocate else "")
    )
    if platform != "cpu" and need > have_gpus:
        return f"{what} needs {need} GPU(s); this cluster has {have_gpus:g}. Lower those sizes or set cluster.colocate=true"
    if need > have_cpus:
        fix = (
            "Raise cluster.num_cpus (logical CPUs of the local Ray) or lower those sizes"
            if platform == "cpu"
            else "Add CPUs"
        )
        return f"{what} needs {need} CPU(s) for its bundles; Ray has {have_cpus:g}. {fix}"
    return None


def check_local_fit(cfg: RunConfig, platform: str, engines_only: bool = False) -> None:
    """Before any actor (in `prepare`): a local Ray must be able to hold the placement, else it would wait
    PLACEMENT_TIMEOUT_S (180 s) for resources that never come. A joined cluster is checked in make_placement."""
    if cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS"):
        return
    custom = sorted({r for r in (cfg.cluster.trainer_resource, cfg.cluster.engine_resource) if r})
    if custom:
        raise ClusterError(
            f"cluster.trainer_resource / engine_resource ask for {custom}, which only the nodes of a "
            f"joined Ray cluster advertise; set cluster.ray_address (or RAY_ADDRESS), or leave them empty"
        )
    gpus = 0
    if platform != "cpu":
        from vime_core.platform import device_facts

        gpus = device_facts(platform).count  # type: ignore[arg-type]
    problem = placement_problem(cfg, platform, local_cpus(cfg), gpus, engines_only)
    if problem:
        raise ClusterError(problem)


def make_placement(cfg: RunConfig, platform: str, engines_only: bool = False) -> Placement:
    """One bundle per device (see module doc); `engines_only` for evaluation without a trainer."""
    got = early_start.take("placement", cfg, platform, engines_only) if early_start is not None else None
    if got is not None:
        return got
    import ray
    from ray.util.placement_group import placement_group

    gpu = platform != "cpu"
    n_train, n_roll = (0 if engines_only else cfg.train.num_devices), cfg.rollout_devices
    tp = cfg.rollout.engine_tensor_parallel_size
    unit = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
    colocate = cfg.cluster.colocate and not engines_only
    first_engine_bundle = 0 if colocate else n_train
    pin = lambda name: {name: 1} if name else {}  # noqa: E731
    bundles = bundle_specs(
        unit, n_train, n_roll, colocate, pin(cfg.cluster.trainer_resource), pin(cfg.cluster.engine_resource)
    )
    engine_b = [
        list(range(first_engine_bundle + e * tp, first_engine_bundle + (e + 1) * tp))
        for e in range(cfg.rollout.num_engines)
    ]
    have = ray.cluster_resources()
    problem = placement_problem(cfg, platform, have.get("CPU", 0), have.get("GPU", 0), engines_only)
    if problem:  # an autoscaling cluster may still grow: say so and wait
        log.warning("%s; waiting up to %d s for the cluster to grow", problem, PLACEMENT_TIMEOUT_S)
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        raise ClusterError(
            f"Ray could not place {len(bundles)} bundle(s) of {unit} within {PLACEMENT_TIMEOUT_S}s; "
            f"cluster resources: {ray.cluster_resources()}. Lower train.num_devices / rollout.num_engines or add nodes."
        )
    p = Placement(pg, list(range(n_train)), engine_b, gpu, colocate, [""] * len(bundles), cfg.cluster.engines_sleep)
    if gpu:
        p.bundle_devices = _bundle_gpus(p, len(bundles))
    return p


def bundle_specs(
    unit: dict, n_train: int, n_roll: int, colocate: bool, trainer_res: dict, engine_res: dict
) -> list[dict]:
    """Trainer bundles then engine bundles (colocated: one shared bundle per device, asking for both), each with the
    custom resources that pin it to its nodes (cluster.trainer_resource / engine_resource)."""
    if colocate:
        return [unit | trainer_res | engine_res for _ in range(n_train)]
    return [unit | trainer_res for _ in range(n_train)] + [unit | engine_res for _ in range(n_roll)]


def _bundle_gpus(p: Placement, n: int) -> list[str]:
    """Which GPU each bundle holds, asked of a tiny task placed in it: actors get that id as their visible device
    (Ray is told not to rewrite visibility), which also lets an engine span the GPUs of several bundles."""
    import ray

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def gpu_id() -> str:
        return str(ray.get_gpu_ids()[0])

    refs = [gpu_id.options(scheduling_strategy=_strategy(p, b)).remote() for b in range(n)]
    return gather(
        refs,
        [f"the GPU probe of bundle {b}" for b in range(n)],
        "its start",
        PLACEMENT_TIMEOUT_S,
        "cluster.PLACEMENT_TIMEOUT_S",
    )


def _strategy(p: Placement, bundle: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=p.pg, placement_group_bundle_index=bundle)


def _actor_env(
    platform: str, device_ids: list[int], cfg: RunConfig | None = None, role: str = "train"
) -> dict[str, str]:
    from vime_core.platform import cpu_threads

    env = worker_env(platform, device_ids)  # visible devices + Ray's NOSET variables + offline variables
    # megatron, vLLM and torch warn on every import about optional packages absent here; keep actor logs readable
    env.setdefault(
        "PYTHONWARNINGS",
        os.environ.get("VIME_ACTOR_WARNINGS", "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning"),
    )
    if platform == "cpu":
        # Ray sets OMP_NUM_THREADS=1 for 1-CPU actors; on-policy trainer and engines take turns, so each may use
        # every core; with rollout.max_staleness > 0 they overlap and split the cores (platform.cpu_threads)
        cores = os.cpu_count() or 1
        if cfg is not None:
            explicit = cfg.train.cpu_threads if role == "train" else cfg.rollout.cpu_threads
            cores = cpu_threads(
                cores, cfg.rollout.max_staleness, role, cfg.train.num_devices, cfg.rollout.num_engines, explicit
            )
        env["OMP_NUM_THREADS"] = str(cores)
    if _local.tmp_dir is not None:
        # temporary files of the actors (vllm_dist_*, pymp-*) go to a dir that shutdown_ray removes, even when Ray
        # kills the actors before their own cleanup runs (see _actors_tmp_dir for torch's compile cache)
        env["TMPDIR"] = str(_local.tmp_dir)
    return env


def _actors_tmp_dir() -> Path:
    """The actors' TMPDIR. torch's compile cache and precompiled headers live in $TMPDIR/torchinductor_<user>: a
    link to the shared one keeps them across runs (rmtree removes the link, not what it points to)."""
    d = Path(tempfile.mkdtemp(prefix="vime-actors-"))
    shared = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    shared.mkdir(exist_ok=True)
    (d / shared.name).symlink_to(shared, target_is_directory=True)
    return d


def _share(p: Placement) -> float:
    """GPU fraction per actor (Ray's accounting): whole devices when disaggregated, shared when colocated."""
    return (0.45 if p.colocate else 1.0) if p.gpu else 0.0


def engine_specs(cfg: RunConfig, p: Placement, platform: str, model_path: str) -> list[tuple[Any, dict, list[int]]]:
    """(EngineOptions, actor environment, bundles) of each engine: everything an engine actor is made from."""
    from vime_core.rollout import EngineOptions

    max_len = cfg.data.max_prompt_len + max(cfg.rollout.max_response_len, cfg.eval.max_response_len or 0)
    specs = []
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
            stack_sample_ms=cfg.rollout.engine_stack_sample_ms,
            custom_generate=cfg.rollout.custom_generate,
            routing_replay=cfg.rollout.routing_replay,
            model_runner=cfg.rollout.model_runner,
            sleep_mode=p.engines_sleep,
            name=f"vLLM engine {i}",
            extra=dict(cfg.rollout.vllm_kwargs),
        )
        specs.append((opts, _actor_env(platform, p.devices(bundles), cfg, "rollout"), bundles))
    return specs


def create_engines(cfg: RunConfig, p: Placement, platform: str, model_path: str) -> list[Any]:
    """Engine actors; they start in the background (see `rpc.wait_ready`)."""
    specs = engine_specs(cfg, p, platform, model_path)
    got = early_start.take("engines", p, specs) if early_start is not None else None
    if got is not None:
        return got
    import ray

    from vime_core.rollout import VLLMEngine

    return [
        ray.remote(VLLMEngine)
        .options(
            num_cpus=0 if p.colocate else 1,
            num_gpus=_share(p),
            scheduling_strategy=_strategy(p, bundles[0]),
            runtime_env={"env_vars": env},
        )
        .remote(opts)
        for opts, env, bundles in specs
    ]


def master_address(p: Placement, bundle: int) -> tuple[str, int]:
    """IP and a free port on the node of `bundle` (where trainer rank 0 runs), found by a task placed there."""
    import ray

    @ray.remote(num_cpus=0, num_gpus=0)
    def probe() -> tuple[str, int]:
        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    ref = probe.options(scheduling_strategy=_strategy(p, bundle)).remote()
    return gather(
        [ref],
        [f"the address probe of bundle {bundle}"],
        "its start",
        PLACEMENT_TIMEOUT_S,
        "cluster.PLACEMENT_TIMEOUT_S",
    )[0]


def create_trainers(
    cfg: RunConfig, p: Placement, platform: str, model_dir: str, init_checkpoint: str | None = None
) -> list[Any]:
    """All trainer ranks, constructed concurrently; they start in the background (each joins the process group), or
    on colocated GPUs once the engines are up (`defer_start`, see `rpc.wait_ready`)."""
    got = early_start.take("trainers", cfg, p, model_dir, init_checkpoint) if early_start is not None else None
    if got is not None:
        return got
    import ray

    from vime_core.trainer import Trainer

    addr, port = master_address(p, p.trainer_bundles[0])
    world = len(p.trainer_bundles)
    actors = [
        ray.remote(Trainer)
        .options(
            num_cpus=1,
            num_gpus=_share(p),
            scheduling_strategy=_strategy(p, bundle),
            runtime_env={"env_vars": _actor_env(platform, p.devices([bundle]), cfg, "train")},
        )
        .remote(cfg, model_dir, rank, world, addr, port, platform, init_checkpoint, defer_start=p.colocated_gpu)
        for rank, bundle in enumerate(p.trainer_bundles)
    ]
    return actors
