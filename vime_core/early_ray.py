"""`vime train` starts Ray and the actors in a background thread while its main thread opens the MLflow run and
`prepare` checks the model and the data (mostly imports: transformers ~4 s, MLflow ~2-3 s, all in the driver);
`vime-pipeline` starts Ray and the engines while it converts the checkpoint the trainer starts from.

Measured on the 2-core box, tiny default, 10 steps: Ray start 2.6-3.6 s and actor start 8.9-9.8 s had run one after
the other behind those ~6 s. The actors started here are the ones the loop asks for (`cluster.make_placement`,
`create_trainers`, `create_engines` take them when they were made from equal inputs, `EarlyStart.key`, and kill them
when not), so results do not change. The checks `prepare` makes before any actor run in the thread first
(milliseconds): when one fails, nothing starts early and `prepare` reports it as before, with no Ray line ahead of
its one-line error. Only a builtin model or a local directory starts early (a download or registry model is resolved
by `prepare` first, or by the pipeline's download task, which passes the directory); `shutdown_ray` stops what
started if the loop never gets there (a bad dataset, nothing left to train).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from vime_core import cluster
from vime_core.config import RunConfig

log = logging.getLogger(__name__)


class EarlyStart:
    """Ray (and the trainer and engine actors) being started by a background thread. The thread lives until
    `cluster.shutdown_ray`: Ray's gcs and raylet die with the *thread* that started them (measured: with a thread
    that had ended, creating an actor hung for 60 s, then `Failed to connect to GCS`)."""

    def __init__(self, cfg: RunConfig, model_dir: str | None = None, trainers: bool = True):
        self.cfg = cfg
        self.model_dir, self.with_trainers = model_dir, trainers
        self.started, self.release = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.skipped = False  # nothing started early (a model to download, or a check that fails)
        self.objects: dict[str, tuple[tuple, Any]] = {}  # kind -> (key, placement or actors)
        self.thread = threading.Thread(target=self._run, name="vime-ray-start", daemon=True)

    def _run(self) -> None:
        from vime_core.platform import detect_platform

        try:
            platform = detect_platform(self.cfg.cluster.platform)
            model_dir = self._checked_model()
        except Exception:  # nothing starts early: `prepare` reports the problem before any Ray line is printed
            model_dir = None
        if model_dir is None:
            self.skipped = True
            self.started.set()
            return
        try:
            logging.getLogger("ray._private.worker").addFilter(_NotMainThreadFilter())
            cluster.init_ray_now(self.cfg, platform)
        except BaseException as e:  # handed to the caller of init_ray
            self.error = e
            self.started.set()
            return
        try:
            self._prestart(platform, model_dir)
        except Exception as e:  # the loop creates them itself, and reports what fails then
            log.debug("prestarting the actors failed (%s); the loop starts them", e)
            self._drop_all()
        finally:
            self.started.set()
        self.release.wait()

    def _checked_model(self) -> str | None:
        """The model directory once the checks `prepare` makes before Ray and any actor have passed here too (the
        model against the config, weights headers, custom generate, output dir, placement fit: milliseconds); None
        for a model `prepare` must download or look up first. A failing check raises: then nothing starts early."""
        from vime_core.checkpoint import read_hf_config
        from vime_core.models import arch_from_hf_config, check_model_compat
        from vime_core.platform import detect_platform
        from vime_core.prepare import preflight
        from vime_core.sources import resolve_model

        cfg = self.cfg
        if cfg.train.pipeline_parallel_size > 1:
            return None
        if self.model_dir is not None:  # resolved already (vime-pipeline's download task)
            path = Path(self.model_dir)
        elif cfg.model.source.startswith("builtin://") or Path(cfg.model.source).is_dir():
            path = resolve_model(cfg.model.source).path
        else:
            return None
        check_model_compat(cfg, arch_from_hf_config(read_hf_config(path), where=path))
        preflight(cfg, detect_platform(cfg.cluster.platform), path, eval_only=False)
        return str(path)

    def _prestart(self, platform: str, model_dir: str) -> None:
        """The actors `train_loop` will create first (taken by cluster.make_placement / create_* when they match)."""
        cfg = self.cfg
        placement = cluster.make_placement(cfg, platform)
        self.objects["placement"] = (self.key("placement", cfg, platform, False), placement)
        if self.with_trainers:
            self.objects["trainers"] = (
                self.key("trainers", cfg, placement, model_dir, None),
                cluster.create_trainers(cfg, placement, platform, model_dir),
            )
        self.objects["engines"] = (
            self.key("engines", placement, cluster.engine_specs(cfg, placement, platform, model_dir)),
            cluster.create_engines(cfg, placement, platform, model_dir),
        )

    @staticmethod
    def key(kind: str, *args) -> tuple:
        """What a prestarted `kind` was made from, compared by value: the loop's config may be another object
        equal to the one started with (vime-pipeline's train task rebuilds it from JSON, with checkpoint.resume set).
        - placement (cfg, platform, engines_only): what make_placement reads;
        - trainers (cfg, placement, model_dir, init_checkpoint): the whole config, which every rank receives;
        - engines (placement, engine_specs): each engine's EngineOptions, actor environment and bundles."""
        if kind == "placement":
            cfg, platform, engines_only = args
            r = cfg.rollout
            return (
                platform,
                engines_only,
                cfg.cluster.model_dump(),
                cfg.train.num_devices,
                r.num_engines,
                r.engine_tensor_parallel_size,
            )
        if kind == "trainers":
            cfg, placement, model_dir, init_checkpoint = args
            return (id(placement), model_dir, init_checkpoint, cfg.model_dump(mode="json"))
        placement, specs = args
        return (id(placement), specs)

    def wait(self) -> bool:
        """Until Ray is up (and the actors were asked for): True; False when nothing was started early (the caller
        starts Ray itself); raises the start's error."""
        self.started.wait()
        if self.error is not None or self.skipped:
            cluster.early_start = None
            self.release.set()
        if self.error is not None:
            raise self.error
        return not self.skipped

    def take(self, kind: str, *args) -> Any:
        """What was prestarted as `kind` if it was made from the same inputs (`key(kind, *args)`; once), else None; a
        mismatch is stopped, so that its devices are free for the ones the caller makes."""
        if threading.current_thread() is self.thread:
            return None  # the prestart itself
        self.started.wait()
        entry = self.objects.pop(kind, None)
        if entry is None:
            return None
        if entry[0] == self.key(kind, *args):
            log.debug("using the %s started in the background", kind)
            return entry[1]
        log.info("the %s started in the background do not match the run's: stopping them", kind)
        self._drop(kind, entry[1])
        return None

    def _drop_all(self) -> None:
        for kind, (_, obj) in list(self.objects.items()):
            self._drop(kind, obj)
        self.objects.clear()

    @staticmethod
    def _drop(kind: str, obj: Any) -> None:
        import ray

        try:
            if kind == "placement":
                ray.util.remove_placement_group(obj.pg)
            else:
                for actor in obj:
                    ray.kill(actor)
        except Exception:  # already gone
            pass


class _NotMainThreadFilter(logging.Filter):
    """Drops Ray's warning that a thread other than the main one cannot set its SIGTERM handler (we set one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def start_ray_early(cfg: RunConfig, model_dir: str | None = None, trainers: bool = True) -> None:
    """Start Ray and the actors of `cfg` in the background now (see the module doc); `cluster.init_ray` waits for
    it. `model_dir`: the model, resolved already; `trainers=False`: the engines only (vime-pipeline: the trainer
    starts from the converted checkpoint, which is made meanwhile). Ray sets no SIGTERM handler outside the main
    thread, so this sets the one Ray would (exit through atexit, where ray.shutdown runs)."""
    if cluster.early_start is not None or ("ray" in sys.modules and sys.modules["ray"].is_initialized()):
        return
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    early = EarlyStart(cfg, model_dir, trainers)
    cluster.early_start = early
    early.thread.start()
