"""Which start failures `start_retry.start_with_retry` starts again (rpc.died_starting), and what the error quotes of the
dead process (actor_logs), and the retry's order of steps. The retry runs for real in tests/e2e/test_start_retry_e2e.py."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from tests.helpers.tiny import tiny_config

from vime_core.actor_logs import dead_actor_pid, log_tail
from vime_core.rpc import ActorLostError, died_starting

DIED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: VLLMEngine\n\tpid: 14649\n"
    "The actor never ran - it was cancelled before it started running."
)


def test_a_process_death_is_retried_and_an_init_exception_is_not():
    assert died_starting(ActorDiedError())  # a system-level death: Ray knows no cause in the actor's code
    assert died_starting(RayActorError(error_msg=DIED))
    assert not died_starting(RayActorError(error_msg="raised in __init__", actor_init_failed=True))
    init_raised = RayTaskError("VLLMEngine.__init__", "Traceback ...", ValueError("bad kwargs"))
    assert not died_starting(ActorDiedError(init_raised))
    assert not died_starting(ValueError("an error of our own code"))


def test_the_pid_is_read_from_rays_message():
    assert dead_actor_pid(RayActorError(error_msg=DIED)) == 14649
    assert dead_actor_pid(RayActorError(error_msg="no process named")) is None


def test_the_tail_quotes_the_dead_workers_files_stderr_first(tmp_path):
    (tmp_path / "worker-abc-01000000-14649.out").write_text("".join(f"out {i}\n" for i in range(30)))
    (tmp_path / "worker-abc-01000000-14649.err").write_text("Fatal Python error: Segmentation fault\n")
    (tmp_path / "worker-def-01000000-99.err").write_text("another process\n")
    tail = log_tail(14649, tmp_path, lines=3).splitlines()
    assert tail == [
        "--- worker-abc-01000000-14649.err (last 3 lines) ---",
        "Fatal Python error: Segmentation fault",
        "--- worker-abc-01000000-14649.out (last 3 lines) ---",
        "out 27",
        "out 28",
        "out 29",
    ]
    assert log_tail(14649, None) == "" and log_tail(7, tmp_path) == ""


def test_start_with_retry_starts_again_on_a_fresh_ray_up_to_the_setting(tmp_path, monkeypatch):
    from vime_core import cluster
    from vime_core.start_retry import start_with_retry

    events: list[str] = []
    monkeypatch.setattr(cluster, "shutdown_ray", lambda: events.append("ray down"))
    monkeypatch.setattr(cluster, "init_ray", lambda cfg, platform: events.append(f"ray up on {platform}"))
    deaths = iter([ActorLostError("vLLM engine 0 failed to start: pid: 7", "vLLM engine 0")])

    def start():
        events.append("start")
        if (death := next(deaths, None)) is not None:
            raise death
        return "engines"

    cfg = tiny_config(tmp_path)
    assert cfg.cluster.start_attempts == 2
    assert start_with_retry(cfg, "cpu", start, lambda: events.append("undo")) == "engines"
    assert events == ["start", "undo", "ray down", "ray up on cpu", "start"]

    events.clear()
    deaths = iter([ActorLostError("trainer rank 0 failed to start", "trainer rank 0")])
    with pytest.raises(ActorLostError):
        start_with_retry(tiny_config(tmp_path, "cluster.start_attempts=1"), "cpu", start, lambda: events.append("undo"))
    assert events == ["start"], "one attempt: the death is the caller's, nothing restarted"
