"""Unit tests of vime_core.platform that need no accelerator: worker environments, limits, offline variables."""

from __future__ import annotations

import logging
import resource

import pytest
import torch

from vime_core import platform as plat
from vime_core.platform import (
    NOSET_CUDA,
    NOSET_HIP,
    OFFLINE_ENV,
    RECOMMENDED_NOFILE,
    PlatformError,
    apply_offline_env,
    check_visible_devices_env,
    detect_platform,
    raise_fd_limit,
    worker_env,
)

HAS_GPU = torch.cuda.is_available() and torch.cuda.device_count() > 0


# --------------------------------------------------------------------------------------------------------------------
# worker environments
# --------------------------------------------------------------------------------------------------------------------
def test_worker_env_rocm():
    env = worker_env("rocm", [0, 1], base={})
    assert env["HIP_VISIBLE_DEVICES"] == "0,1"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env[NOSET_CUDA] == "1"
    assert env[NOSET_HIP] == "1"


def test_noset_names_are_the_ones_ray_reads():
    """Checked against the installed Ray, not against a copy of the string: a Ray that renames the variable would
    otherwise pass here while it overrides our device assignment again."""
    from ray._private.accelerators import amd_gpu, nvidia_gpu

    assert NOSET_CUDA == nvidia_gpu.NOSET_CUDA_VISIBLE_DEVICES_ENV_VAR
    assert NOSET_HIP == amd_gpu.NOSET_HIP_VISIBLE_DEVICES_ENV_VAR


def test_worker_env_cuda_has_no_hip_variables():
    env = worker_env("cuda", [3], base={})
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env[NOSET_CUDA] == "1"
    assert "HIP_VISIBLE_DEVICES" not in env
    assert NOSET_HIP not in env


def test_worker_env_cpu_hides_devices():
    env = worker_env("cpu", None, base={})
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert NOSET_CUDA not in env and NOSET_HIP not in env and "HIP_VISIBLE_DEVICES" not in env


def test_worker_env_includes_offline_variables():
    env = worker_env("cuda", [0], base={})
    for k, v in OFFLINE_ENV.items():
        assert env[k] == v
    assert env["DO_NOT_TRACK"] == "true"


def test_worker_env_user_offline_value_wins():
    base = {"DO_NOT_TRACK": "false", "TOKENIZERS_PARALLELISM": "true"}
    env = worker_env("cpu", None, base=base)
    # not overridden: the worker inherits the user's value from the base environment
    assert "DO_NOT_TRACK" not in env and "TOKENIZERS_PARALLELISM" not in env
    merged = {**base, **env}
    assert merged["DO_NOT_TRACK"] == "false"
    assert merged["TOKENIZERS_PARALLELISM"] == "true"
    assert merged["RAY_USAGE_STATS_ENABLED"] == "0"  # the others are still set


def test_worker_env_refuses_rocr_without_hip():
    with pytest.raises(PlatformError, match="HIP_VISIBLE_DEVICES"):
        worker_env("rocm", [0], base={"ROCR_VISIBLE_DEVICES": "0"})


def test_worker_env_default_base_is_os_environ(monkeypatch):
    monkeypatch.setenv("DO_NOT_TRACK", "custom")
    monkeypatch.delenv("ROCR_VISIBLE_DEVICES", raising=False)
    env = worker_env("cpu", None)
    assert "DO_NOT_TRACK" not in env


# --------------------------------------------------------------------------------------------------------------------
# visible-devices check
# --------------------------------------------------------------------------------------------------------------------
def test_check_visible_devices_env_rocr_alone():
    with pytest.raises(PlatformError) as ei:
        check_visible_devices_env({"ROCR_VISIBLE_DEVICES": "0"})
    msg = str(ei.value)
    assert "HIP_VISIBLE_DEVICES=0" in msg
    assert "ROCR_VISIBLE_DEVICES" in msg


@pytest.mark.parametrize(
    "environ",
    [
        {"ROCR_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "0"},
        {"HIP_VISIBLE_DEVICES": "1"},
        {"ROCR_VISIBLE_DEVICES": ""},  # empty counts as unset
        {},
    ],
)
def test_check_visible_devices_env_ok(environ):
    check_visible_devices_env(environ)  # no exception


# --------------------------------------------------------------------------------------------------------------------
# open-file limit
# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def nofile():
    """The (soft, hard) open-file limit, restored after the test. Only the soft limit is changed by tests."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield soft, hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _lower_soft(hard: int) -> int:
    low = 256 if hard == resource.RLIM_INFINITY else min(256, hard - 1)
    if low < 64:
        pytest.skip(f"hard open-file limit {hard} is too low to lower the soft limit below it")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    return low


def test_raise_fd_limit_raises_soft_to_hard(nofile, caplog):
    _, hard = nofile
    if hard == resource.RLIM_INFINITY:
        pytest.skip("hard limit is unlimited here; raise_fd_limit then aims at RECOMMENDED_NOFILE instead")
    low = _lower_soft(hard)
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low
    with caplog.at_level(logging.WARNING, logger=plat.__name__):
        got = raise_fd_limit(gpu=False)
    assert got == hard
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    assert not caplog.records  # no GPU, no warning


def test_raise_fd_limit_warns_on_gpu_below_recommended(nofile, caplog):
    _, hard = nofile
    if hard == resource.RLIM_INFINITY or hard >= RECOMMENDED_NOFILE:
        pytest.skip(
            f"hard open-file limit here is {hard} (>= {RECOMMENDED_NOFILE}); lowering a hard limit is irreversible "
            "for the test process, so the GPU warning is not exercised"
        )
    _lower_soft(hard)
    with caplog.at_level(logging.WARNING, logger=plat.__name__):
        got = raise_fd_limit(gpu=True)
    assert got == hard
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"open-file limit is {hard}" in warnings[0].getMessage()
    assert str(RECOMMENDED_NOFILE) in warnings[0].getMessage()


def test_raise_fd_limit_when_already_at_hard(nofile, caplog):
    _, hard = nofile
    if hard == resource.RLIM_INFINITY:
        pytest.skip("hard limit is unlimited here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    with caplog.at_level(logging.WARNING, logger=plat.__name__):
        assert raise_fd_limit(gpu=False) == hard
    assert not caplog.records


# --------------------------------------------------------------------------------------------------------------------
# platform detection
# --------------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU; the test is about CPU-only machines")
def test_detect_platform_auto_is_cpu():
    assert detect_platform("auto") == "cpu"
    assert detect_platform() == "cpu"


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU; the test is about CPU-only machines")
@pytest.mark.parametrize("requested", ["cuda", "rocm"])
def test_detect_platform_gpu_on_cpu_machine_raises(requested):
    with pytest.raises(PlatformError) as ei:
        detect_platform(requested)
    msg = str(ei.value)
    assert f"cluster.platform = {requested}" in msg and "sees cpu" in msg


def test_detect_platform_cpu_always_allowed():
    assert detect_platform("cpu") == "cpu"


def test_small_platform_helpers():
    assert plat.dist_backend("cpu") == "gloo"
    assert plat.dist_backend("rocm") == "nccl"
    facts = plat.device_facts("cpu")
    assert (facts.platform, facts.count, facts.names) == ("cpu", 0, [])
    assert plat.current_device_uuid("cpu") == "cpu"


# --------------------------------------------------------------------------------------------------------------------
# offline variables
# --------------------------------------------------------------------------------------------------------------------
def test_apply_offline_env_on_a_dict():
    environ = {"DO_NOT_TRACK": "false", "OTHER": "x"}
    apply_offline_env(environ)
    assert environ["DO_NOT_TRACK"] == "false"  # not overridden
    assert environ["OTHER"] == "x"
    assert environ["MLFLOW_DISABLE_TELEMETRY"] == "true"
    assert environ["RAY_USAGE_STATS_ENABLED"] == "0"
    assert environ["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert set(OFFLINE_ENV) | {"OTHER"} == set(environ)


def test_apply_offline_env_on_empty_dict_sets_everything():
    environ: dict[str, str] = {}
    apply_offline_env(environ)
    assert environ == OFFLINE_ENV
    assert environ is not OFFLINE_ENV


def test_cpu_threads_split_the_cores_only_when_trainer_and_engines_overlap():
    from vime_core.platform import cpu_threads

    assert cpu_threads(2, 0, "train") == 2 and cpu_threads(2, 0, "rollout") == 2
    assert cpu_threads(2, 1, "train") == 1 and cpu_threads(2, 1, "rollout") == 1
    assert cpu_threads(16, 2, "rollout", num_trainers=2, num_engines=2) == 4
    assert cpu_threads(2, 1, "train", num_trainers=2, num_engines=2) == 1
    assert cpu_threads(2, 1, "train", explicit=2) == 2
