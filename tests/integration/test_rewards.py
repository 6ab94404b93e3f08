"""vime_core.rewards' symbolic checks in math-verify worker processes (vime_core/verify_pool.py): answers only
math-verify can tell, batched checks, label parsing, the time limit that kills a worker, and workers that die with
their process."""

from __future__ import annotations

import pytest

from vime_core.rewards import RewardModel, math_reward
from vime_core.sample import Sample


def _sample(response: str, label: str) -> Sample:
    return Sample(group_id=0, prompt_ids=[1, 2, 3], label=label, response=response, finish_reason="stop")


@pytest.mark.parametrize("response, label", [(r"\boxed{\sqrt{4}}", "2")])  # only math-verify can tell
def test_math_reward_correct(response, label):
    assert math_reward(response, label) == 1.0


@pytest.mark.parametrize("response, label", [(r"\boxed{\sqrt{4}}", "3")])
def test_math_reward_wrong(response, label):
    assert math_reward(response, label) == 0.0


def test_math_reward_has_a_time_limit_off_the_main_thread():
    """math-verify's own timeout (SIGALRM) is off outside the main thread; 9^9^9^9 hung a thread for > 120 s.
    The worker process is killed at the limit and the answer scores 0; the next call gets a fresh worker. (A limit
    under 1 s: at 2 s math-verify's own 1 s alarm per phase now stops this one first, and nothing is killed.)"""
    import threading

    from vime_core.verify_pool import shared_pool

    pool = shared_pool()
    killed = pool.killed
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(r=math_reward(r"so \boxed{9^{9^{9^{9}}}}", "5", timeout_s=0.5)))
    th.start()
    th.join(timeout=60)
    assert not th.is_alive() and out["r"] == 0.0
    assert pool.killed == killed + 1
    assert math_reward(r"\boxed{\sqrt{4}}", "2") == 1.0  # symbolic path works again


def test_reward_model_math_batches_symbolic_checks():
    gs = [
        [
            _sample(r"\boxed{\sqrt{9}}", label="3"),
            _sample(r"\boxed{\frac{6}{2}}", label="3"),
            _sample(r"\boxed{x}", label="3"),
        ]
    ]
    RewardModel("math", timeout_s=5).score(gs)
    assert [[x.reward for x in g] for g in gs] == [[1.0, 1.0, 0.0]]


def test_usable_labels():
    from vime_core.rewards import usable_labels

    assert usable_labels(["5", "-3/4", r"\frac{1}{2}", r"\frac{1}{", "}{", "???", "1e3"]) == [
        True,
        True,
        True,
        False,
        False,
        False,
        True,
    ]


def test_check_labels_counts_warns_and_refuses_all_bad(caplog):
    from vime_core.data import DatasetError, Prompt, PromptSet, check_labels
    from vime_core.rewards import usable_labels

    def ps(*labels):
        return PromptSet(
            "data/x.jsonl", [Prompt(index=i, prompt_ids=[1], prompt="p", label=lab) for i, lab in enumerate(labels)]
        )

    with caplog.at_level("WARNING"):
        assert check_labels(ps("5", r"\frac{1}{", "7"), usable_labels, "answer") == 1
    assert "1 of 3 labels (field 'answer') cannot be read" in caplog.text and r"row 2: '\\frac{1}{'" in caplog.text
    assert check_labels(ps("5", "6"), usable_labels, "answer") == 0
    with pytest.raises(
        DatasetError, match=r"dataset data/x.jsonl: none of its 2 labels \(field 'answer', data.label_key\)"
    ):
        check_labels(ps("}{", "???"), usable_labels, "answer")


_POOL_OWNER = r"""
import sys, threading, time
from vime_core.verify_pool import VerifyPool
pool = VerifyPool(1)
out = {}
# the worker is started by a thread that ends: it must outlive that thread, and die only with this process
th = threading.Thread(target=lambda: out.update(r=pool.run("label", [("1/2",)], 20.0)))
th.start(); th.join()
time.sleep(0.5)
pid = pool.idle[0].proc.pid
print(out["r"], pool.run("label", [("1/3",)], 20.0), pool.killed, pool.idle[0].proc.pid == pid, pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_math_verify_workers_die_with_their_process():
    import subprocess
    import sys
    import time

    owner = subprocess.Popen([sys.executable, "-c", _POOL_OWNER], stdout=subprocess.PIPE, text=True)
    try:
        first, second, killed, same, pid = owner.stdout.readline().split()
        assert (first, second, killed, same) == ("[True]", "[True]", "0", "True")  # one worker served both calls
        assert _alive(int(pid))
    finally:
        owner.kill()
        owner.wait()
    for _ in range(300):  # the kernel's SIGKILL is immediate; poll for up to 30 s on a loaded host
        if not _alive(int(pid)):
            break
        time.sleep(0.1)
    assert not _alive(int(pid))
