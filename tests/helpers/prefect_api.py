"""A Prefect server's REST API and CLI as the e2e tests drive them: start/stop processes, poll, call."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

from tests.helpers.tiny import REPO

BIN = Path(sys.executable).parent


def wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} not up after {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, grace: float = 30) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def api(env: dict, path: str, body: dict | None = None, method: str | None = None, attempts: int = 5):
    """One Prefect REST call. Every call the tests make is a read or an idempotent write (a forced state), so a
    timeout is retried: on the 2-core CI box a training flow run can starve the server for more than 30 s, which
    Prefect's own client rides out with retries too."""
    req = urllib.request.Request(
        env["PREFECT_API_URL"] + path,
        method=method or ("POST" if body is not None else "GET"),
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read() or "null")
        except urllib.error.HTTPError:
            raise  # the server answered: a real error, not a slow server
        except (TimeoutError, ConnectionError, urllib.error.URLError) as e:
            if attempt == attempts - 1:
                raise TimeoutError(f"Prefect API {path} did not answer in {attempts} tries") from e
            time.sleep(5)


def wait_until(fn, timeout: float, what: str, interval: float = 2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(interval)
    raise TimeoutError(f"{what} after {timeout}s")


def prefect(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "prefect"), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


# -- flow runs of a deployment (`d`: {"env": its Prefect environment, "id": its id}) -----------------------------------
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def flow_runs(d: dict, state_types: list[str] | None = None) -> list[dict]:
    body = {"flow_runs": {"deployment_id": {"any_": [d["id"]]}}, "sort": "EXPECTED_START_TIME_ASC"}
    if state_types:
        body["flow_runs"]["state"] = {"type": {"any_": state_types}}
    return api(d["env"], "/flow_runs/filter", body)


def run_scheduled(d: dict, run: dict) -> dict:
    """A run the scheduler created, moved to now, run by the worker: its final flow run."""
    now = datetime.now(timezone.utc).isoformat()
    api(
        d["env"],
        f"/flow_runs/{run['id']}/set_state",
        {"state": {"type": "SCHEDULED", "name": "Scheduled", "state_details": {"scheduled_time": now}}, "force": True},
    )
    return wait_until(
        lambda: (fr := api(d["env"], f"/flow_runs/{run['id']}"))["state"]["type"] in TERMINAL and fr,
        1200,
        "the scheduled run did not finish",
        interval=5,
    )


def night_pair(scheduled: list[dict]) -> tuple[dict, dict] | None:
    """The first date with two scheduled runs (a deployment with two nightly crons): (its first run, its second); None
    while there is none. Not simply the earliest run: between the two cron times today's first night is past, so the
    earliest scheduled run is today's second night, whose date has no other."""
    by_date: dict[str, list[dict]] = {}
    for r in scheduled:  # in expected start order (flow_runs)
        by_date.setdefault(r["expected_start_time"][:10], []).append(r)
    return next(((runs[0], runs[1]) for runs in by_date.values() if len(runs) >= 2), None)
