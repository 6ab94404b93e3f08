"""The rollout schedule of both loop modes (vime_core/schedule.py) without engines: which policy version each rollout
samples from, when versions may be pushed, what a checkpoint carries, and that a resume repeats the schedule."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.helpers.tiny import REPO
from vime_core.config import RunConfig
from vime_core.sample import Sample
from vime_core.schedule import (
    VERSION_KEY,
    FinishedRollout,
    RolloutScheduler,
    StalenessResumeError,
    behaviour_version,
    check_staleness_resume,
    last_rollout_before_push,
    read_inflight,
    staleness_metrics,
    startable,
    wait_time_ratio,
    write_inflight,
)


def simulate(n: int, num_rollout: int, first: int = 0, carried: list[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The loop's calls on the pure functions: (rollout id, version) in the order rollouts start."""
    loaded, started, finished = first, list(carried), {j for j, _ in carried}
    nxt = max(finished, default=first - 1) + 1

    def submit():
        nonlocal nxt
        for j in startable(nxt, loaded, n, num_rollout):
            started.append((j, loaded))
            nxt = j + 1

    submit()
    for k in range(first, num_rollout):
        assert k in {j for j, _ in started}, f"step {k} trains a rollout that never started"
        for j, _ in started:  # before the push of k + 1 every older-version rollout is done
            if j <= last_rollout_before_push(k + 1, n):
                finished.add(j)
        assert all(v <= k for j, v in started if j not in finished), "a running rollout would see new weights"
        loaded = k + 1
        submit()
    return started


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_each_rollout_samples_the_version_the_formula_names_within_the_bound(n):
    started = simulate(n, 9)
    assert [j for j, _ in started] == list(range(9)), "every rollout starts once, in order"
    for j, v in started:
        assert v == behaviour_version(j, 0, n) == max(0, j - n)
        assert 0 <= j - v <= n
    assert max(j - v for j, v in started) == min(n, 8)  # the bound is reached, not only respected


def test_on_policy_schedule_is_todays_loop():
    assert simulate(0, 5) == [(j, j) for j in range(5)]
    assert list(startable(3, 3, 0, 10)) == [3] and list(startable(4, 3, 0, 10)) == []


def test_staleness_one_is_train_async():
    """slime's train_async: rollout k+1 starts with the weights of version k, i.e. before step k trains."""
    assert simulate(1, 4) == [(0, 0), (1, 0), (2, 1), (3, 2)]
    assert last_rollout_before_push(3, 1) == 3  # rollout 3 (version 2) finishes before version 3 is pushed


@pytest.mark.parametrize("n,ckpt", [(1, 3), (2, 4), (3, 2)])
def test_resume_with_the_carried_rollouts_repeats_the_schedule(n, ckpt):
    """A checkpoint after step `ckpt` carries rollouts ckpt+1 .. ckpt+n (versions the checkpoint no longer has)."""
    whole = simulate(n, 10)
    carried = [(j, v) for j, v in whole if ckpt + 1 <= j <= last_rollout_before_push(ckpt + 1, n)]
    assert len(carried) == n
    assert simulate(n, 10, first=ckpt + 1, carried=carried) == [(j, v) for j, v in whole if j > ckpt]


def test_metrics_helpers():
    assert staleness_metrics(5, [4, 4, 5, 3]) == {"rollout/staleness/mean": 1.0, "rollout/staleness/max": 2.0}
    assert staleness_metrics(0, []) == {"rollout/staleness/mean": 0.0, "rollout/staleness/max": 0.0}
    assert wait_time_ratio(0.25, 1.0) == 0.25 and wait_time_ratio(2.0, 1.0) == 1.0 and wait_time_ratio(1.0, 0.0) == 0.0


# --------------------------------------------------------------------------------------------------------------------
# the scheduler object with a fake rollout
# --------------------------------------------------------------------------------------------------------------------
def fake_rollout(calls: list):
    def run(j: int, version: int) -> FinishedRollout:
        calls.append((j, version, threading.current_thread().name))
        s = Sample(
            group_id=0,
            prompt_ids=[1, 2],
            metadata={VERSION_KEY: version},
            response_ids=[3],
            rollout_logprobs=[-0.1 * (j + 1) / 3],
            reward=1.0,
        )
        return FinishedRollout(j, version, [[s]], {"rollout/raw_reward": 1.0}, [j])

    return run


def drive(sched: RolloutScheduler, first: int, last: int, stop_after: int | None = None) -> list[int]:
    """The loop's calls on the scheduler; returns the version of each trained step."""
    versions = []
    sched.submit_ready()
    for k in range(first, last):
        r = sched.take(k)
        versions.append(r.version)
        sched.before_push(k + 1)
        sched.pushed(k + 1)
        if k == stop_after:
            return versions
        sched.submit_ready()
    return versions


def test_inline_mode_samples_on_the_callers_thread():
    calls: list = []
    sched = RolloutScheduler(fake_rollout(calls), 0, 4, 0)
    assert drive(sched, 0, 4) == [0, 1, 2, 3]
    assert [c[2] for c in calls] == [threading.current_thread().name] * 4
    sched.close()


def test_async_mode_runs_ahead_in_the_background_and_carries_what_a_checkpoint_needs():
    calls: list = []
    sched = RolloutScheduler(fake_rollout(calls), 2, 8, 0)
    assert drive(sched, 0, 8, stop_after=3) == [0, 0, 0, 1]
    carried = sched.carried()  # after the push of version 4: rollouts 4 and 5 (versions 2, 3) are done, not trained
    assert [(r.rollout_id, r.version) for r in carried] == [(4, 2), (5, 3)]
    assert all(c[2].startswith("vime-rollout") for c in calls)
    sched.close()
    # resumed from that checkpoint: the rest of the schedule is the uninterrupted one's
    ref_calls: list = []
    ref = RolloutScheduler(fake_rollout(ref_calls), 2, 8, 0)
    whole = drive(ref, 0, 8)
    ref.close()
    resumed_calls: list = []
    resumed = RolloutScheduler(fake_rollout(resumed_calls), 2, 8, 4, carried)
    assert drive(resumed, 4, 8) == whole[4:]
    resumed.close()
    assert [c[:2] for c in resumed_calls] == [c[:2] for c in ref_calls if c[0] >= 6]


def test_a_checkpoint_refuses_to_record_running_rollouts():
    gate = threading.Event()

    def slow(j, v):
        gate.wait(10)
        return FinishedRollout(j, v, [], {}, [])

    sched = RolloutScheduler(slow, 1, 5, 0)
    sched.submit_ready()
    with pytest.raises(RuntimeError, match="still run"):
        sched.carried()
    gate.set()
    sched.close()


def test_a_failed_background_rollout_reaches_the_trainer_step():
    def boom(j, v):
        raise ValueError(f"engine died at rollout {j}")

    sched = RolloutScheduler(boom, 1, 5, 0)
    sched.submit_ready()
    with pytest.raises(ValueError, match="engine died at rollout 0"):
        sched.take(0)
    sched.close()


# --------------------------------------------------------------------------------------------------------------------
# what a checkpoint holds
# --------------------------------------------------------------------------------------------------------------------
def test_carried_rollouts_round_trip_exactly(tmp_path: Path):
    r = fake_rollout([])(7, 6)
    r.groups[0][0].rollout_logprobs = [-0.1 / 3, -1e-300, -123.456789012345678]
    ids = write_inflight(tmp_path, [r])
    back = read_inflight(tmp_path, {"inflight_rollouts": ids})
    assert ids == [7] and back[0] == r  # dataclass equality: every float bit for bit
    assert read_inflight(tmp_path, {}) == []
    with pytest.raises(StalenessResumeError, match=r"names \[8\]"):
        read_inflight(tmp_path, {"inflight_rollouts": [8]})


def test_resume_needs_the_staleness_the_checkpoint_was_written_with():
    check_staleness_resume({}, 0)  # checkpoints of on-policy runs carry no key
    check_staleness_resume({"max_staleness": 2}, 2)
    with pytest.raises(StalenessResumeError, match="written with rollout.max_staleness = 1, this run has 0"):
        check_staleness_resume({"max_staleness": 1}, 0)
    with pytest.raises(StalenessResumeError, match="max_staleness = 0, this run has 2"):
        check_staleness_resume({}, 2)


# --------------------------------------------------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------------------------------------------------
def test_use_tis_auto_follows_staleness():
    assert RunConfig().grpo.use_tis is False  # on-policy: unchanged, so old checkpoints' fingerprints still match
    assert RunConfig.model_validate({"rollout": {"max_staleness": 1}}).grpo.use_tis is True
    assert RunConfig.model_validate({"rollout": {"max_staleness": 1}, "grpo": {"use_tis": False}}).grpo.use_tis is False
    assert RunConfig.model_validate({"grpo": {"use_tis": True}}).grpo.use_tis is True
    assert RunConfig.model_validate({"grpo": {"policy_loss": "gspo"}}).grpo.use_tis is False
    with pytest.raises(ValueError, match="rollout.max_staleness = 1 with grpo.policy_loss = gspo"):
        RunConfig.model_validate({"rollout": {"max_staleness": 1}, "grpo": {"policy_loss": "gspo"}})
    gspo_off = RunConfig.model_validate(
        {"rollout": {"max_staleness": 1}, "grpo": {"policy_loss": "gspo", "use_tis": False}}
    )
    assert gspo_off.grpo.use_tis is False


def test_kuberay_manifest_advertises_the_placement_resources():
    """infra/kuberay places trainer and engines on their own nodes by the resources tests/e2e/test_two_nodes_e2e.py
    uses."""
    import json

    import yaml

    (rc,) = [d for d in yaml.safe_load_all((REPO / "infra" / "kuberay" / "raycluster.yaml").read_text()) if d]
    advertised = {
        g["groupName"]: json.loads(json.loads(g["rayStartParams"]["resources"])) for g in rc["spec"]["workerGroupSpecs"]
    }
    assert advertised == {"trainer": {"vime_trainer": 8}, "rollout": {"vime_engine": 8}}


def test_placement_resources_go_into_the_bundles():
    from vime_core.cluster import bundle_specs

    assert bundle_specs({"GPU": 1}, 2, 1, False, {"vime_trainer": 1}, {"vime_engine": 1}) == [
        {"GPU": 1, "vime_trainer": 1},
        {"GPU": 1, "vime_trainer": 1},
        {"GPU": 1, "vime_engine": 1},
    ]
    assert bundle_specs({"GPU": 1}, 1, 1, True, {"a": 1}, {"b": 1}) == [{"GPU": 1, "a": 1, "b": 1}]


def test_placement_resources_need_a_joined_cluster(monkeypatch, tmp_path):
    from vime_core.cluster import ClusterError, check_local_fit

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = RunConfig.model_validate({"cluster": {"trainer_resource": "vime_trainer"}, "output_dir": str(tmp_path)})
    with pytest.raises(ClusterError, match=r"ask for \['vime_trainer'\].*cluster.ray_address"):
        check_local_fit(cfg, "cpu")
