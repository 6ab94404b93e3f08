"""Children die with their parent: the watchdog takes a server that a library started (as Prefect starts its
temporary server in `vime-pipeline`) with the parent, and `die_with_parent` sets the parent-death signal. The whole
`vime train` and `vime-pipeline` under SIGKILL: tests/e2e/test_faults_orphans.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

from tests.helpers.orphans import GRACE_S, descendants, wait_gone
from tests.helpers.tiny import REPO


def test_the_watchdog_takes_a_library_started_server_with_it(tmp_path):
    """A parent starts a 'server' it cannot give a preexec_fn (as Prefect does) and the watchdog; SIGKILL the parent."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import subprocess, sys, time
        from vime_core.orphans import start_watchdog
        start_watchdog()
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        print("up", flush=True)
        time.sleep(600)
    """),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout.readline().strip() == "up"
    time.sleep(1.5)  # the watchdog's first snapshot
    known = descendants(parent.pid)
    assert any("time.sleep(600)" in cmd for _, cmd in known.values()), known
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    left = wait_gone(known, GRACE_S)
    assert not left, f"orphans left behind: {left}"


def test_die_with_parent_sets_pdeathsig():
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import ctypes, signal
        from vime_core.orphans import die_with_parent
        assert die_with_parent(signal.SIGTERM)
        sig = ctypes.c_int()
        ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
        print(sig.value)
    """),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr
    assert int(child.stdout) == signal.SIGTERM
