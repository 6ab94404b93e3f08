"""The nightly pipeline's output-dir lock against a real second process: a second run is refused naming the holder,
the lock is re-entrant in a process and freed when its holder dies, and `vime train` on a held dir exits 2 in one
line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.tiny import REPO


HOLD = textwrap.dedent("""
    import sys, time
    from vime_core.runlock import output_dir_lock
    with output_dir_lock(sys.argv[1], "flow-run-1234"):
        print("held", flush=True)
        time.sleep(120)
""")


@pytest.fixture
def held_dir(tmp_path):
    """`tmp_path/run` held by another process, as a running flow would hold it."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.stdout.readline().strip() == "held"
    yield out, proc
    proc.kill()
    proc.wait()


def test_a_second_run_on_a_held_output_dir_is_refused_naming_the_holder(held_dir):
    from vime_core.runlock import RunLockedError, output_dir_lock

    out, proc = held_dir
    with pytest.raises(RunLockedError) as e:
        with output_dir_lock(out):
            pass
    msg = str(e.value)
    assert f"pid {proc.pid} on " in msg and "flow run flow-run-1234" in msg and str(out) in msg
    assert "\n" not in msg


def test_the_lock_is_reentrant_in_a_process_and_freed_when_its_holder_dies(held_dir):
    from vime_core.runlock import HOLDER_FILE, output_dir_lock

    out, proc = held_dir
    proc.kill()
    proc.wait()
    with output_dir_lock(out, "mine"):
        with output_dir_lock(out):  # the loop inside the flow takes it again
            assert '"flow_run": "mine"' in (out / HOLDER_FILE).read_text()
        assert (out / HOLDER_FILE).exists(), "the inner block must not release the outer one"
    assert not (out / HOLDER_FILE).exists()


def test_vime_train_on_a_held_output_dir_exits_2_with_one_line(held_dir):
    out, proc = held_dir
    r = subprocess.run(
        [
            str(Path(sys.executable).parent / "vime"),
            "train",
            "--config",
            "configs/tiny-cpu.yaml",
            "--set",
            f"output_dir={out}",
            "--set",
            "tracking.enabled=false",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "RunLockedError" in line]
    assert len(lines) == 1 and f"pid {proc.pid}" in lines[0] and "flow-run-1234" in lines[0], r.stderr[-2000:]
