"""The async loop across Ray nodes: a head and a second raylet on this machine (both 127.0.0.1, joined through
RAY_ADDRESS), told apart by custom resources; the trainer is pinned to one node and the engine to the other by
cluster.trainer_resource / engine_resource (as infra/kuberay/raycluster.yaml does), and where they ran is asked of
Ray (the actors' node ids against `ray.nodes()`), not read back from the config."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.tiny import REPO


RAY = Path(sys.executable).parent / "ray"
STEPS = 3

DRIVER = (
    r"""
import json, sys
import ray
from tests.helpers.tiny import tiny_config
from vime_core.loop import run
from vime_core.metrics import MemorySink

cfg = tiny_config(sys.argv[1], "rollout.num_rollout=%d", "eval.datasets=[]", "tracking.enabled=false",
                  "rollout.max_staleness=1", "cluster.trainer_resource=vime_trainer",
                  "cluster.engine_resource=vime_engine", "checkpoint.save_interval=100")
sink = MemorySink()
result = run(cfg, sink)
ray.init(address="auto")
nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
print("RESULT " + json.dumps({"trainer": [i["node_id"] for i in result.trainer_info],
                              "engine": [i["node_id"] for i in result.engine_info], "nodes": nodes,
                              "staleness": [r["rollout/staleness/max"] for r in sink.rows if "rollout/staleness/max" in r]}))
"""
    % STEPS
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def two_nodes():
    from vime_core.platform import OFFLINE_ENV

    tmp = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    # the actors inherit these from their raylet: offline, and vLLM / gloo on loopback (cluster.LOOPBACK_ENV's choice)
    env |= OFFLINE_ENV | {"VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    # Ray 2.60 authenticates nodes and drivers with a token: one per cluster, handed to the nodes and the driver
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port = free_port()
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=2", "--disable-usage-stats"]
    head = [
        str(RAY),
        "start",
        "--head",
        f"--port={port}",
        "--include-dashboard=false",
        f"--temp-dir={tmp}",
        "--resources",
        json.dumps({"vime_trainer": 1}),
        "--min-worker-port=21000",
        "--max-worker-port=21999",
        *common,
    ]
    worker = [
        str(RAY),
        "start",
        f"--address=127.0.0.1:{port}",
        "--resources",
        json.dumps({"vime_engine": 1}),
        "--min-worker-port=22000",
        "--max-worker-port=22999",
        *common,
    ]
    try:
        for cmd in (head, worker):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, f"{' '.join(cmd[:3])} failed:\n{done.stdout[-1500:]}{done.stderr[-1500:]}"
        yield env | {"RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        stop_ours(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def stop_ours(tmp: Path) -> None:
    """Stop the processes of these two nodes only (their command lines name our temp dir), never by name: other Ray
    clusters on this machine are not ours (`ray stop` would stop every one)."""
    import psutil

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(tmp) in " ".join(p.info["cmdline"] or []):
                procs.append(p)
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def test_async_loop_with_trainer_and_engine_on_different_nodes(two_nodes, tmp_path, dense_model_dir):
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "run")],
        cwd=REPO,
        env=two_nodes,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    assert len(got["nodes"]) == 2, got["nodes"]
    (trainer_node,), (engine_node,) = got["trainer"], got["engine"]
    assert trainer_node != engine_node
    assert "vime_trainer" in got["nodes"][trainer_node] and "vime_engine" in got["nodes"][engine_node]
    assert got["staleness"] == [0.0] + [1.0] * (STEPS - 1)
