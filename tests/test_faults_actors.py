"""A hung actor: every driver -> actor call has a timeout, and the error names the actor and what it was doing.
Real Ray actors that sleep stand in for a stopped vLLM engine and a stuck trainer rank (seconds, no engines)."""

from __future__ import annotations

import time

import pytest

from tests.helpers.tiny import tiny_config
from vime_core.errors import ActorTimeoutError

pytestmark = pytest.mark.e2e  # starts Ray: serialise with the other heavy tests


class Sleepy:
    """Answers like an engine / a trainer rank, but `hang` seconds late."""

    def __init__(self, hang: float):
        self.hang = hang

    def generate(self, requests, spec):
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


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    from vime_core.cluster import init_ray, shutdown_ray

    init_ray(tiny_config(tmp_path_factory.mktemp("ray"), "cluster.num_cpus=4"), "cpu")
    yield
    shutdown_ray()


def actors(*hangs: float) -> list:
    import ray

    return [ray.remote(Sleepy).options(num_cpus=0).remote(h) for h in hangs]


def test_a_hung_engine_is_named_with_what_it_was_doing(local_ray):
    from vime_core.rollout import GroupRequest, RolloutRouter, SamplingSpec
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
    from vime_core.rollout import RolloutRouter
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
