"""A local run exposes nothing beyond 127.0.0.1: every listening socket of a real `vime train` (the driver and all
its descendants: Ray's gcs, raylet, workers, agents and monitor, the trainer with its torch.distributed store, the
vLLM engine, megatron's checkpoint helpers) is polled while it runs, and any non-loopback address fails the test.
Joining a cluster (RAY_ADDRESS) is the documented exception and is not covered here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.helpers.tiny import REPO


VIME = Path(sys.executable).parent / "vime"
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
POLL_S = 0.2  # megatron's save helpers live for about a second: poll often


def listening(root, sessions: set[str]) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every LISTEN socket of `root` and its descendants, now; the Ray session
    dirs named on their command lines go to `sessions`."""
    import psutil

    found = set()
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return found
    for p in procs:
        try:
            sessions.update(re.findall(r"/tmp/ray/session_[0-9_-]+", " ".join(p.cmdline())))
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.add((p.name(), c.laddr.ip, c.laddr.port))
        except psutil.Error:
            pass
    return found


def test_a_local_run_listens_on_loopback_only(tmp_path):
    import psutil

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = [
        str(VIME),
        "train",
        "-c",
        "configs/tiny-cpu.yaml",
        "--set",
        f"output_dir={tmp_path / 'run'}",
        "--set",
        "rollout.num_rollout=2",
        "--set",
        "checkpoint.save_interval=1",
        "--set",
        "eval.datasets=[]",
        "--set",
        "tracking.enabled=false",
    ]
    log = tmp_path / "train.log"
    proc = subprocess.Popen(
        args, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    seen: set[tuple[str, str, int]] = set()
    sessions: set[str] = set()
    root = psutil.Process(proc.pid)

    def poll() -> None:
        while proc.poll() is None:
            seen.update(listening(root, sessions))
            time.sleep(POLL_S)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    poller.join(timeout=10)
    assert rc == 0, log.read_text()[-3000:]
    names = {name for name, _, _ in seen}
    print(f"{len(seen)} listening sockets seen, processes: {sorted(names)}")
    assert {"gcs_server", "raylet"} <= names, f"the poller must see Ray's sockets: {sorted(seen)}"
    assert any(n.startswith("ray::Trainer") for n in names), "and the trainer's (its torch.distributed store)"
    exposed = sorted(s for s in seen if s[1] not in LOOPBACK)
    assert not exposed, f"listening beyond loopback: {exposed}"
    # and a run that ends normally leaves no Ray session dir behind
    assert sessions and not [d for d in sessions if Path(d).exists()], sessions
