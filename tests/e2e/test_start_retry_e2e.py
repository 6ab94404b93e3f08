"""An actor whose process dies while starting (as the OOM killer or a crash in a native library would end it) costs
the run a second start on a fresh Ray, not the run: the vLLM engine's process is SIGKILLed during its `__init__`
and the run still trains. With cluster.start_attempts = 1 the same death fails the run, naming the engine."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import psutil
import pytest

from tests.helpers.tiny import tiny_config
from vime_core.metrics import MemorySink


def kill_first_engine_while_starting(killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the first vLLM engine actor process among this test's descendants while it runs its `__init__`
    (Ray titles it `ray::VLLMEngine.__init__`); other pytest workers' engines are not this process's descendants."""
    while not stop.is_set() and not killed:
        for child in psutil.Process().children(recursive=True):
            try:
                if "VLLMEngine.__init__" in " ".join(child.cmdline()):
                    os.kill(child.pid, signal.SIGKILL)
                    killed.append(child.pid)
                    return
            except psutil.Error:
                continue
        time.sleep(0.05)


def run_with_one_engine_killed(tmp_path, *overrides: str):
    from vime_core.loop import run

    cfg = tiny_config(tmp_path, "rollout.num_rollout=1", "eval.datasets=[]", "tracking.enabled=false", *overrides)
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=kill_first_engine_while_starting, args=(killed, stop), daemon=True)
    killer.start()
    sink = MemorySink()
    try:
        return run(cfg, sink), sink, killed
    finally:
        stop.set()
        killer.join()


def test_an_engine_killed_while_starting_is_started_again_and_the_run_trains(tmp_path, dense_model_dir, caplog):
    caplog.set_level(logging.WARNING, logger="vime_core.start_retry")
    result, sink, killed = run_with_one_engine_killed(tmp_path)
    assert len(killed) == 1, "the engine was never seen starting: nothing was tested"
    warnings = [r.getMessage() for r in caplog.records if "cluster.start_attempts" in r.getMessage()]
    assert len(warnings) == 1 and "vLLM engine 0 failed to start" in warnings[0], warnings
    assert f"pid: {killed[0]}" in warnings[0], "the warning names the process that died"
    assert f"-{killed[0]}.err (last" in warnings[0], "and quotes what that process wrote last"
    assert result.last_rollout_id == 0
    assert [r["step"] for r in sink.rows if "rollout/raw_reward" in r] == [0]


def test_with_one_start_attempt_the_death_fails_the_run_naming_the_engine(tmp_path, dense_model_dir):
    from vime_core.rpc import ActorLostError

    with pytest.raises(ActorLostError) as e:
        run_with_one_engine_killed(tmp_path, "cluster.start_attempts=1")
    assert e.value.who == "vLLM engine 0" and "vLLM engine 0 failed to start" in str(e.value)
    assert not list((tmp_path / "checkpoints").glob("iter_*")), "nothing was trained, so nothing was saved"
