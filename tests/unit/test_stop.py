"""What a stop signal means to a run (vime_core/stop.py) and to the pipeline: which signal an error stands for, no
retry once a Ctrl-C was caught, the MLflow run ending KILLED with the signal's name. The signals sent to real
processes: tests/e2e/test_interrupt_e2e.py."""

from __future__ import annotations

import os
import signal
import time

import pytest
from prefect.exceptions import TerminationSignal
from prefect.states import Failed

from flows.grpo_pipeline import fail_tracking
from tasks.common import is_transient
from vime_core import stop
from vime_core.stop import stop_on_signal, stop_signal


@pytest.mark.parametrize(
    "error, signum",
    [
        (KeyboardInterrupt(), signal.SIGINT),
        (TerminationSignal(signal.SIGTERM), signal.SIGTERM),  # Prefect's, raised by its SIGTERM handler
        (RuntimeError("boom"), None),
        (OSError(5, "EIO"), None),
        (SystemExit(1), None),
    ],
)
def test_the_signal_an_error_stands_for(error, signum):
    assert stop_signal(error) == signum


def test_a_caught_signal_names_the_stop_whatever_error_follows_and_blocks_retries():
    lost_actor = RuntimeError("actor died")  # a Ctrl-C reaches the actors too: one may fail before the driver stops
    assert is_transient(None, None, Failed(data=lost_actor))
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs in the background (nohup, `&`)
    with stop_on_signal((signal.SIGINT,)) as caught:
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at once
        assert caught == [signal.SIGINT]
        assert stop_signal(lost_actor) == signal.SIGINT
        assert not is_transient(None, None, Failed(data=lost_actor))
    assert stop_signal(lost_actor) is None, "a later run in the same process starts unstopped"
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_that_lands_in_a_finalizer_still_stops_the_run():
    """An exception raised in `__del__` is printed and dropped: a Ctrl-C handled there used to be lost, and the
    evaluation it was meant to stop ran to the end and exited 0."""

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, inside the finalizer
            time.sleep(0.01)

    with stop_on_signal((signal.SIGINT,)) as caught:
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            Finalized()  # dropped at once: its __del__ runs
            time.sleep(5)  # the signal comes again once the finalizer returned
        assert caught == [signal.SIGINT]


def test_a_finalizer_that_blocks_defers_the_signal_only_so_long(monkeypatch):
    """Past the cap the signal is taken where it lands: Python drops that KeyboardInterrupt, but the stop is recorded,
    so the run's retry condition sees it and a second Ctrl-C ends the process at once."""
    monkeypatch.setattr(stop, "MAX_DEFERRALS", 3)

    class Blocking:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):  # ~1 s: 20 redeliveries' worth, more than the cap
                time.sleep(0.01)

    with stop_on_signal((signal.SIGINT,)) as caught:
        Blocking()
        assert caught == [signal.SIGINT]


@pytest.mark.parametrize(
    "error, status, tag",
    [
        (KeyboardInterrupt(), "KILLED", "KeyboardInterrupt: stopped by SIGINT"),
        (TerminationSignal(signal.SIGTERM), "KILLED", "TerminationSignal: stopped by SIGTERM"),
        (RuntimeError("boom"), "FAILED", "RuntimeError: boom"),
    ],
)
def test_the_pipelines_mlflow_run_ends_killed_for_a_signal(error, status, tag):
    calls = []
    fail_tracking({}, "run-1", error, finish=lambda *a, **k: calls.append((a, k)))
    ((args, kwargs),) = calls
    assert args[1] == "run-1" and kwargs["status"] == status
    assert list(kwargs["tags"].values()) == [tag]
