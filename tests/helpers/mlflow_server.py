"""A real `mlflow server` on 127.0.0.1 for tests that stop and restart it
(tests/integration/test_tracking_outage.py, tests/e2e/test_team_server_e2e.py)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def restartable_port() -> int:
    """A free port for a server that is stopped and started again on it, below the kernel's ephemeral range
    (ip_local_port_range, 32768-60999 by default): inside it, an outgoing connection or a bind to port 0 (Ray, vLLM,
    torch rendezvous) can take the port while the server is down, as one did in a CI run (Errno 98 at the restart).
    Above Ray's worker ports (10002-19999) and Prefect's temporary servers (8000-8999)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = list(range(20000, low))
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-{low - 1} for a restartable server")


def start_server(root: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "DO_NOT_TRACK": "true"}
    args = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "art")]
    log = open(root / "server.log", "a")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(1)
    raise TimeoutError((root / "server.log").read_text()[-3000:])


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
