"""bench/detached.sh: a second batch on the GPU machine keeps the first one's files and never starts over a live one."""

import os
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "detached.sh"


def detached(root: Path, cwd: Path, *args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "VIME_DETACHED_ROOT": str(root), "OUT": str(out or cwd / "out")}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def wait_until_gone(pid: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def test_a_new_batch_keeps_the_earlier_batchs_results_and_polls_bring_them(tmp_path):
    root, checkout = tmp_path / "root", tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "marker.txt").write_text("the checkout")
    (root / "res" / "l1").mkdir(parents=True)
    (root / "res" / "30b-a3b-5l-4096.json").write_text("{}")
    (root / "res" / "l1" / "30b-a3b-5l-4096.json").write_text('{"variant": 1}')
    (root / "res" / "DONE").touch()
    (root / "out-l1").mkdir()

    started = detached(root, checkout, "start", "--shape tiny")
    assert started.returncode == 0, started.stderr
    wait_until_gone(int((root / "run.pid").read_text()))  # the run itself fails here: no /tmp/site-env.sh or no GPU
    kept = list((root / "earlier").iterdir())
    assert len(kept) == 1
    assert (kept[0] / "res" / "l1" / "30b-a3b-5l-4096.json").read_text() == '{"variant": 1}'
    assert (kept[0] / "out-l1").is_dir()
    assert (root / "repo" / "marker.txt").is_file() and (root / "runs.txt").read_text() == "--shape tiny\n"

    out = tmp_path / "polled"
    assert detached(root, checkout, "poll", "0", out=out).returncode == 0
    back = out / f"earlier-{kept[0].name}"
    assert (back / "30b-a3b-5l-4096.json").is_file() and (back / "l1" / "30b-a3b-5l-4096.json").is_file()


def test_a_start_while_a_batch_runs_is_refused_and_touches_nothing(tmp_path):
    root, checkout = tmp_path / "root", tmp_path / "checkout"
    checkout.mkdir()
    (root / "res").mkdir(parents=True)
    (root / "res" / "run1.log").write_text("half a run")
    running = subprocess.Popen(["sleep", "60"])
    try:
        (root / "run.pid").write_text(str(running.pid))
        refused = detached(root, checkout, "start", "--shape tiny")
    finally:
        running.kill()
        running.wait()
    assert refused.returncode == 2
    assert "still running" in refused.stderr and str(root) in refused.stderr
    assert (root / "res" / "run1.log").read_text() == "half a run" and not (root / "earlier").exists()
