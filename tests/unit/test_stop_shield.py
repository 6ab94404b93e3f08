"""vime_core/stop.py's shield: a stop signal waits for the end of a block it must not cut in two (an MLflow call)."""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import pytest

from vime_core import stop
from vime_core.stop import ShieldedCalls, shielded, stop_on_signal


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_inside_a_shielded_block_stops_the_run_as_the_block_ends():
    done = []
    with stop_on_signal((signal.SIGINT,)) as caught:
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            with shielded():
                ctrl_c()
                time.sleep(0.2)  # the write the signal must not cut
                done.append("written")
            time.sleep(5)  # not reached: the block's end raised
        assert done == ["written"] and caught == [signal.SIGINT]


def test_a_block_that_outlasts_the_hold_is_stopped_inside_it(monkeypatch):
    monkeypatch.setattr(stop, "HOLD_S", 0.1)
    reached = []
    with stop_on_signal((signal.SIGINT,)) as caught:
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            with shielded():
                ctrl_c()
                for _ in range(500):  # 5 s, far past the hold
                    time.sleep(0.01)
                reached.append("the end of the block")
        assert reached == [] and caught == [signal.SIGINT]
        time.sleep(0.3)  # nothing more comes: a stray signal now would end the process (a stop is recorded)


def test_a_second_signal_inside_the_block_stops_the_run_at_once():
    reached = []
    with stop_on_signal((signal.SIGINT,)) as caught:
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            with shielded():
                ctrl_c()
                time.sleep(0.05)
                ctrl_c()
                time.sleep(5)
                reached.append("the end of the block")
        assert reached == [] and caught == [signal.SIGINT]


def test_a_held_signal_that_was_raised_sends_no_late_copy(monkeypatch):
    monkeypatch.setattr(stop, "HOLD_S", 0.1)
    with stop_on_signal((signal.SIGINT,)) as caught:
        with pytest.raises(KeyboardInterrupt):
            with shielded():
                ctrl_c()
                time.sleep(0.02)
        time.sleep(0.3)  # past the hold: its timer was cancelled, else the copy would end this process
        assert caught == [signal.SIGINT]


def test_every_call_through_shielded_calls_finishes_before_the_stop():
    class Store:
        version = 3

        def __init__(self):
            self.rows = []

        def log(self, row):
            ctrl_c()
            time.sleep(0.05)
            self.rows.append(row)
            return len(self.rows)

    store = Store()
    client = ShieldedCalls(store)
    assert client.version == 3
    assert copy.copy(client).version == 3  # a copy is built without __init__: no recursion through its wrapped object
    with stop_on_signal((signal.SIGINT,)):
        with pytest.raises(KeyboardInterrupt):
            client.log("metrics of step 4")
    assert store.rows == ["metrics of step 4"]


def test_another_threads_block_holds_nothing():
    entered, leave = threading.Event(), threading.Event()

    def tracking_thread():
        with shielded():
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=tracking_thread)
    t.start()
    try:
        entered.wait(10)
        with stop_on_signal((signal.SIGINT,)) as caught:
            with pytest.raises(KeyboardInterrupt, match="SIGINT"):
                ctrl_c()
                time.sleep(5)  # the main thread is in no shielded block: the handler raises at once
            assert caught == [signal.SIGINT]
    finally:
        leave.set()
        t.join()
