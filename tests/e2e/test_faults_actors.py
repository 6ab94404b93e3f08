"""A hung actor: every driver -> actor call has a timeout, and the error names the actor and what it was doing.
Real Ray actors that sleep stand in for a stopped vLLM engine and a stuck trainer rank (seconds, no engines)."""

from __future__ import annotations

import re
import time

import pytest

from tests.helpers.tiny import tiny_config
from vime_core.errors import ActorTimeoutError


class Sleepy:
    """Answers like an engine / a trainer rank, but `hang` seconds late."""

    def __init__(self, hang: float):
        self.hang = hang

    def generate(self, requests, spec, cold_cache=False):
        time.sleep(self.hang)
        return [[] for _ in requests]

    def reset_prefix_cache(self):
        time.sleep(self.hang)

    def sleep(self, level):
        time.sleep(self.hang)

    def train(self, rollout_id, batch):
        time.sleep(self.hang)
        return {}

    def save_checkpoint(self, path):
        time.sleep(self.hang)

    def shutdown(self):
        pass

    def ready(self):
        return True


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    from vime_core.cluster import init_ray, shutdown_ray

    init_ray(tiny_config(tmp_path_factory.mktemp("ray"), "cluster.num_cpus=4"), "cpu")
    yield
    shutdown_ray()


def actors(*hangs: float) -> list:
    """Started and answering before a test's timeout runs: an actor's first call waits for its worker process, which on
    a loaded 2-core machine (two test workers) took longer than the 2 s timeout, so even the prompt engine timed out."""
    import ray

    handles = [ray.remote(Sleepy).options(num_cpus=0).remote(h) for h in hangs]
    ray.get([h.ready.remote() for h in handles], timeout=120)
    return handles


def test_a_hung_engine_is_named_with_what_it_was_doing(local_ray):
    from vime_core.rollout import GroupRequest, SamplingSpec
    from vime_core.router import RolloutRouter
    from vime_core.sample import Sample

    router = RolloutRouter(actors(0.0, 60.0), timeout_s=2)
    requests = [GroupRequest(Sample(group_id=i, prompt_ids=[1] * (i + 1)), seed=i) for i in range(4)]
    with pytest.raises(ActorTimeoutError) as e:
        router.generate(requests, SamplingSpec(2, 1.0, 1.0, 0, 8))
    msg = str(e.value)
    assert msg.startswith("vLLM engine 1 did not finish generate") and "vLLM engine 0" not in msg
    assert "within 2 s (rollout.timeout_s)" in msg
    with pytest.raises(ActorTimeoutError, match=r"vLLM engine 1 did not finish reset_prefix_cache .*rollout.timeout_s"):
        router.call_all("reset_prefix_cache")


def test_a_hung_engine_during_a_weight_sync_names_sync_timeout(local_ray):
    from vime_core.router import RolloutRouter
    from vime_core.sync import WeightSync

    sync = WeightSync(None, RolloutRouter(actors(60.0), timeout_s=1800), "cpu", engines_sleep=True, timeout_s=1)
    with pytest.raises(ActorTimeoutError, match=r"vLLM engine 0 did not finish sleep within 1 s \(sync.timeout_s\)"):
        sync.release_engines()


def test_a_hung_trainer_rank_is_named(local_ray, tmp_path):
    from vime_core.trainer import TrainerGroup

    group = TrainerGroup(actors(0.0, 60.0), tiny_config(tmp_path, "train.timeout_s=10"))
    with pytest.raises(
        ActorTimeoutError, match=r"^trainer rank 1 did not finish save_checkpoint within 10 s \(train.timeout_s\)"
    ):
        group.save_checkpoint(str(tmp_path))
    with pytest.raises(ActorTimeoutError, match=r"^trainer rank 1 did not finish train within 1 s \(train.timeout_s\)"):
        group.call_all("train", 7, [], timeout_s=1)


def test_calls_that_answer_in_time_are_unaffected(local_ray):
    from vime_core.rpc import gather

    a = actors(0.0, 0.0)
    assert gather([x.generate.remote([1, 2], None) for x in a], ["a", "b"], "generate", 30, "rollout.timeout_s") == [
        [[], []],
        [[], []],
    ]


class Beating:
    """Works in units, beating after each (vime_core.progress) as an engine step or a micro-batch does."""

    def __init__(self, who: str):
        from vime_core.progress import Heartbeat

        self.heartbeat = Heartbeat(who)

    def work(self, units: int, unit_s: float, then_hang_s: float = 0.0) -> int:
        for _ in range(units):
            time.sleep(unit_s)
            self.heartbeat.beat("a unit")
        time.sleep(then_hang_s)
        return units


def beating(*names: str) -> list:
    import ray

    made = [ray.remote(Beating).options(num_cpus=0).remote(n) for n in names]
    ray.get([a.work.remote(0, 0.0) for a in made])  # started: a window counts from the call, as for a ready engine
    return made


STALL = dict(setting="test.stall_s", what="no unit finished")


def test_a_call_longer_than_the_stall_window_that_keeps_beating_is_not_a_stall(local_ray):
    from vime_core.rpc import Stall, gather

    # 12 units of 0.4 s: the call takes ~4.8 s, twice the window, but never goes 2.5 s without a beat
    (a,) = beating("worker 0")
    got = gather([a.work.remote(12, 0.4)], ["worker 0"], "work", 60, "test.timeout_s", Stall(2.5, **STALL))
    assert got == [12]


def test_beats_reach_the_board_of_every_later_call(local_ray):
    from vime_core.rpc import Stall, gather

    # the actor found the board during the first call; a board made anew for the second (the first one's handle
    # dropped) would never hear its beats and call the 4.8 s of steady progress a stall after 2.5 s
    (a,) = beating("worker 4")
    assert gather([a.work.remote(3, 0.2)], ["worker 4"], "work", 60, "test.timeout_s", Stall(2.5, **STALL)) == [3]
    got = gather([a.work.remote(12, 0.4)], ["worker 4"], "work", 60, "test.timeout_s", Stall(2.5, **STALL))
    assert got == [12]


def test_an_actor_that_stops_beating_is_reported_long_before_its_timeout(local_ray):
    from vime_core.errors import ActorStallError
    from vime_core.rpc import Stall, gather

    a, b = beating("worker 0", "worker 1")
    refs = [a.work.remote(20, 0.2), b.work.remote(3, 0.2, then_hang_s=60)]
    with pytest.raises(ActorStallError) as e:
        gather(refs, ["worker 0", "worker 1"], "work", 600, "test.timeout_s", Stall(2.0, **STALL))
    # only the hung one is named (worker 0 keeps beating); the window and its setting are in the one line
    assert re.fullmatch(
        r"worker 1 stalled in work: no unit finished for \d+ s \(the window is test.stall_s = 2 s\); the actor is "
        r"hung: see its log above, or raise test.stall_s \(0 turns the check off\)",
        str(e.value),
    ), str(e.value)


def test_an_actor_that_never_beats_is_a_stall_from_the_call_start(local_ray):
    import ray

    from vime_core.errors import ActorStallError
    from vime_core.progress import board
    from vime_core.rpc import Stall, gather

    (a,) = beating("worker 2")
    ray.get(board().ages.remote([]))  # the board is up before the call: on a loaded box its start can outlast polls
    with pytest.raises(ActorStallError, match=r"^worker 2 stalled in work: no unit finished for \d+ s"):
        gather([a.work.remote(0, 0.0, then_hang_s=60)], ["worker 2"], "work", 600, "t.timeout_s", Stall(1.5, **STALL))


def test_a_stall_window_of_zero_leaves_only_the_timeout(local_ray):
    from vime_core.rpc import Stall, gather

    (a,) = beating("worker 3")
    with pytest.raises(ActorTimeoutError) as e:
        gather([a.work.remote(0, 0.0, then_hang_s=60)], ["worker 3"], "work", 3, "t.timeout_s", Stall(0, **STALL))
    assert type(e.value) is ActorTimeoutError, e.value
    assert "within 3 s (t.timeout_s)" in str(e.value)


def test_shutdown_kills_hung_ranks_instead_of_waiting_on_each(local_ray, tmp_path):
    import ray

    from vime_core.trainer import TrainerGroup

    group = TrainerGroup(actors(0.0, 600.0, 600.0), tiny_config(tmp_path))
    busy = [a.train.remote(0, []) for a in group.actors]  # ranks 1 and 2 hang in train: their shutdown never runs
    ray.get(busy[0])
    group.shutdown()
    for ref in busy[1:]:
        with pytest.raises(ray.exceptions.RayActorError):  # killed: the hung call ends with the actor
            ray.get(ref, timeout=60)
