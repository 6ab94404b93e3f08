"""Riding out a tracking server outage: wait for the store to answer, and a metrics sink that keeps what a
restarting server did not take. The retry schedule is `tracking.outage_s` (the Prefect tasks' own retries for the
same setting: tasks/common.py `tracking_retries`)."""

from __future__ import annotations

import logging
import time

from vime_core.tracking import TrackingUnreachableError, check_reachable

log = logging.getLogger(__name__)


def wait_reachable(uri: str, outage_s: float) -> None:
    """check_reachable, retried 2 s apart (doubling up to 60 s) for `outage_s` (`tracking.outage_s`)."""
    deadline, delay = time.monotonic() + outage_s, 2.0
    while True:
        try:
            return check_reachable(uri)
        except TrackingUnreachableError:
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 60.0)


class OutageTolerantSink:
    """A MetricsSink around an MLflow one (MlflowRun, EvalChildRuns) that trains on through a tracking server
    outage: a row the server did not take (and the store then does not answer) is kept, with its original time,
    and sent before the next row; `close` waits up to `outage_s` for the rest. Any other error raises as before.
    Without it a restart of the server mid-training failed the train task and its retry restarted the engines."""

    def __init__(self, sink, uri: str, outage_s: float):
        self.sink, self.uri, self.outage_s = sink, uri, outage_s
        self.pending: list[tuple[int, dict[str, float], int]] = []

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.pending.append((step, metrics, int(time.time() * 1000)))
        self.flush()

    def flush(self) -> bool:
        """Send what is pending, oldest first; False when the store stopped answering (the rest is kept)."""
        while self.pending:
            step, metrics, ts = self.pending[0]
            try:
                self.sink.log_metrics(step, metrics, timestamp_ms=ts)
            except Exception:
                try:
                    check_reachable(self.uri)
                except TrackingUnreachableError as e:
                    log.warning("%s; %d metric row(s) kept to send when it answers", e, len(self.pending))
                    return False
                raise  # the store answers: the error is the row's, not the outage's
            self.pending.pop(0)
        return True

    def close(self) -> None:
        deadline, delay = time.monotonic() + self.outage_s, 2.0
        while not self.flush():
            if time.monotonic() + delay > deadline:
                raise TrackingUnreachableError(
                    f"MLflow tracking store {self.uri} did not answer for tracking.outage_s = {self.outage_s:g} s; "
                    f"{len(self.pending)} metric row(s) not logged (metrics.jsonl in the output dir has them)"
                )
            time.sleep(delay)
            delay = min(2 * delay, 60.0)
        self.sink.close()
