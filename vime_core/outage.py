"""Riding out a tracking server outage: wait for the store to answer, and a metrics sink that keeps what a
restarting server did not take. One retry schedule, `retry_delays` of `tracking.outage_s`, serves both and the
Prefect tasks' own retries (tasks/common.py `tracking_retries`)."""

from __future__ import annotations

import logging
import math
import time

from vime_core.tracking import TrackingUnreachableError, check_reachable

log = logging.getLogger(__name__)


RECHECK_S = 10  # the longest wait between two checks of a store that does not answer, for outages up to 400 s


def retry_delays(outage_s: float) -> list[int]:
    """Seconds to wait between attempts while the tracking store does not answer (`tracking.outage_s`; the Prefect
    tasks' retries use the same list): 2, 4, 8, then every RECHECK_S, until they sum to `outage_s`. A restarted server
    is seen within RECHECK_S of answering again, where a delay that kept doubling would see it that much late. Longer
    outages check every outage_s / 40 s, so that no list is longer than 44 (Prefect allows 50 retries; outage_s
    <= 1800)."""
    cap = max(RECHECK_S, math.ceil(outage_s / 40))
    delays: list[int] = []
    while sum(delays) < outage_s:
        delays.append(min(2 ** (len(delays) + 1), cap))
    return delays


def wait_reachable(uri: str, outage_s: float) -> None:
    """check_reachable, retried `retry_delays(outage_s)` apart (`tracking.outage_s`)."""
    for delay in [*retry_delays(outage_s), None]:
        try:
            return check_reachable(uri)
        except TrackingUnreachableError:
            if delay is None:
                raise
            time.sleep(delay)


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
        for delay in [*retry_delays(self.outage_s), None]:
            if self.flush():
                break
            if delay is None:
                raise TrackingUnreachableError(
                    f"MLflow tracking store {self.uri} did not answer for tracking.outage_s = {self.outage_s:g} s; "
                    f"{len(self.pending)} metric row(s) not logged (metrics.jsonl in the output dir has them)"
                )
            time.sleep(delay)
        self.sink.close()
