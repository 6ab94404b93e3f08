"""vime_core.memory on CPU: the offload bookkeeping with torch AdamW (state out and back, the same tensors, training
continues exactly), when offload is enabled, and the out-of-memory error that names train.max_tokens_per_device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.tiny import tiny_config
from vime_core.errors import VimeError
from vime_core.memory import HostOffload, MemoryBudgetError, PhasePeaks, offload_enabled, train_step_memory


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt, x):
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()


def test_offload_moves_state_out_and_back_without_changing_training():
    x = torch.randn(5, 6, dtype=torch.float32)
    ref_model, ref_opt = _model_and_optimizer()
    model, opt = _model_and_optimizer()
    off = HostOffload(opt, model, model, torch.device("cpu"))
    for _ in range(3):
        _step(ref_model, ref_opt, x)
        _step(model, opt, x)
        state_ids = {id(t) for st in opt.state.values() for t in st.values()}
        before = [t.clone() for st in opt.state.values() for t in st.values()]
        assert off.offload() >= 0.0 and off.offloaded
        assert all(p.grad is None for p in model.parameters())  # gradients are dropped while offloaded
        assert off.host_bytes() > 0
        assert off.offload() == 0.0  # a second call is a no-op
        off.onload()
        after = [t for st in opt.state.values() for t in st.values()]
        assert {id(t) for t in after} == state_ids  # the optimizer keeps the same tensor objects
        assert all(torch.equal(a, b) for a, b in zip(after, before))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_model_weights_stay_where_they_are():
    model, opt = _model_and_optimizer()
    _step(model, opt, torch.randn(2, 6, dtype=torch.float32))
    off = HostOffload(opt, model, model, torch.device("cpu"))
    weights = {p.data_ptr() for p in model.parameters()}
    off.offload()
    assert {p.data_ptr() for p in model.parameters()} == weights  # not copied, not moved
    off.onload()


@pytest.mark.parametrize(
    "setting, engines_sleep, platform, want",
    [
        ("auto", True, "cuda", True),
        ("auto", False, "cuda", False),
        (True, False, "cuda", True),
        (False, True, "cuda", False),
        ("auto", True, "cpu", False),
        (True, True, "cpu", False),
    ],
)
def test_offload_is_on_for_colocated_gpus(setting, engines_sleep, platform, want):
    assert offload_enabled(setting, engines_sleep, platform) is want


def _fake_trainer(budget: int, recompute: str = "none", platform: str = "cpu"):
    """A step runner as the wrapper sees it: its RankState's cfg, platform, device, peaks and last onload time."""
    cfg = SimpleNamespace(train=SimpleNamespace(max_tokens_per_device=budget, recompute=recompute))
    cpu = torch.device("cpu")
    st = SimpleNamespace(cfg=cfg, platform=platform, device=cpu, peaks=PhasePeaks(cpu), onload_time=0.0)
    return SimpleNamespace(st=st)


def test_out_of_memory_names_the_budget_and_a_value_that_may_fit():
    @train_step_memory
    def train(self, rollout_id, steps):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.50 GiB")

    steps = [[SimpleNamespace(tokens=[1] * 4136), SimpleNamespace(tokens=[1] * 1064)]]
    with pytest.raises(MemoryBudgetError) as e:
        train(_fake_trainer(16384), 0, steps)
    msg = str(e.value)
    assert isinstance(e.value, VimeError) and "\n" not in msg
    assert msg.startswith("train.max_tokens_per_device = 16384 does not fit")
    assert "lower it to 8192" in msg and "train.recompute" in msg


def test_out_of_memory_with_one_sample_over_the_budget_asks_for_recompute():
    @train_step_memory
    def train(self, rollout_id, steps):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(MemoryBudgetError, match=r"longest sample alone does not fit: set train.recompute = full"):
        train(_fake_trainer(4096), 0, [[SimpleNamespace(tokens=[1] * 4136)]])


@pytest.mark.parametrize(
    "recompute, platform, fix",
    [
        ("auto", "cuda", "lower it to 8192 (the longest sample has 4136 tokens) or set train.recompute = full"),
        ("full", "cuda", "lower it to 8192 (the longest sample has 4136 tokens)"),
        ("auto", "cpu", "or set train.recompute = selective / full"),
    ],
)
def test_out_of_memory_suggests_only_a_heavier_recompute_than_the_run_has(recompute, platform, fix):
    @train_step_memory
    def train(self, rollout_id, steps):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(MemoryBudgetError) as e:
        train(_fake_trainer(16384, recompute, platform), 0, [[SimpleNamespace(tokens=[1] * 4136)]])
    assert str(e.value).endswith(fix)


def test_the_wrapper_passes_metrics_through_on_cpu():
    @train_step_memory
    def train(self, rollout_id, steps):
        return {"train/loss": 1.5}

    assert train(_fake_trainer(9216), 0, []) == {"train/loss": 1.5}


def test_the_offload_after_a_step_reports_into_that_step():
    """The loop merges what `offload_optimizer` returns into the step that just trained (run 5 on an H200 showed the
    first offload's 13.7 s under the next step when the train wrapper reported it)."""
    from vime_core.trainer.group import TrainerGroup

    timed = {"perf/optimizer_offload_time": 13.7, "perf/trainer_resident_after_offload_gib": 3.3}
    on = SimpleNamespace(call_all=lambda name: [timed, dict(timed)])
    assert TrainerGroup.offload_optimizer(on) == timed
    off = SimpleNamespace(call_all=lambda name: [None, None])
    assert TrainerGroup.offload_optimizer(off) == {}
    off.call_all = lambda name: pytest.fail("asked again after the ranks said offload is off")
    assert TrainerGroup.offload_optimizer(off) == {}


@pytest.mark.parametrize("sleep", [True, False])
def test_colocated_engines_sleep_unless_cluster_engines_sleep_is_false(tmp_path, sleep):
    """cluster.engines_sleep=false: no vLLM sleep mode and no optimizer offload, but the engines still start first
    (their KV sizing must not see the trainers' allocations either way)."""
    from vime_core.cluster import Placement, engine_specs
    from vime_core.memory import offload_enabled

    cfg = tiny_config(tmp_path, "cluster.colocate=true", "train.num_devices=1", f"cluster.engines_sleep={sleep}")
    p = Placement(None, [0], [[0]], True, True, ["0"], cfg.cluster.engines_sleep)
    assert p.colocated_gpu and p.engines_sleep is sleep
    assert engine_specs(cfg, p, "cuda", "/m")[0][0].sleep_mode is sleep
    assert offload_enabled(cfg.train.offload_optimizer, cfg.cluster.sleeping_engines, "cuda") is sleep
    cpu = Placement(None, [0], [[0]], False, True, [""], True)
    assert not cpu.colocated_gpu and not cpu.engines_sleep


def test_the_first_offload_is_cut_from_host_memory_pinned_while_the_rank_was_idle():
    x = torch.randn(5, 6, dtype=torch.float32)
    ref_model, ref_opt = _model_and_optimizer()
    model, opt = _model_and_optimizer()
    off = HostOffload(opt, model, model, torch.device("cpu"))
    # two Adam moments and the step count per weight, known before the optimizer creates them in its first step
    step = (torch.Size(()), torch.float32)
    assert off.expected_host_buffers() == [b for p in model.parameters() for b in [(p.shape, p.dtype)] * 2 + [step]]
    off.start_prepinning()
    for _ in range(2):
        _step(ref_model, ref_opt, x)
        _step(model, opt, x)
        off.offload()
        # the moments and steps fill the reserved slabs: nothing pinned beyond them, then or later
        assert off.reserved_bytes > 0 and off.host_bytes() == off.reserved_bytes and off.unforeseen_bytes() == 0
        off.onload()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_a_mis_forecast_shape_costs_no_second_copy():
    """The pre-pinning reserves slabs and the buffers are cut at the offload: a state tensor whose shape or dtype the
    forecast got wrong (here every one is forecast flat, as bytes) still lands in the reserved memory."""
    model, opt = _model_and_optimizer()
    off = HostOffload(opt, model, model, torch.device("cpu"))
    forecast = off.expected_host_buffers()
    assert all(d == torch.float32 for _, d in forecast)
    off.expected_host_buffers = lambda: [((s.numel() * 4,), torch.uint8) for s, _ in forecast]  # same bytes
    off.start_prepinning()
    _step(model, opt, torch.randn(5, 6, dtype=torch.float32))
    off.offload()
    assert off.host_bytes() == off.reserved_bytes > 0 and off.unforeseen_bytes() == 0


def test_what_the_forecast_missed_is_pinned_beside_it_and_reported():
    model, opt = _model_and_optimizer()
    off = HostOffload(opt, model, model, torch.device("cpu"))
    forecast = off.expected_host_buffers()
    off.expected_host_buffers = lambda: forecast[: len(forecast) // 3]  # a third of it
    off.start_prepinning()
    _step(model, opt, torch.randn(5, 6, dtype=torch.float32))
    off.offload()
    assert off.unforeseen_bytes() > 0 and off.host_bytes() == off.reserved_bytes + off.unforeseen_bytes()


def test_a_host_without_room_refuses_the_offload_and_training_goes_on():
    """Pinning past Ray's memory-monitor line would get the trainer killed with no word of why: the arena refuses the
    slab with HostMemoryError naming the setting, the state stays on the device and the next step still runs."""
    from vime_core.pinned import HostMemoryError

    x = torch.randn(5, 6, dtype=torch.float32)
    ref_model, ref_opt = _model_and_optimizer()
    model, opt = _model_and_optimizer()
    off = HostOffload(opt, model, model, torch.device("cpu"))
    off.arena.room = lambda: 1024  # bytes the host can still give
    off.start_prepinning()
    _step(ref_model, ref_opt, x)
    _step(model, opt, x)
    with pytest.raises(HostMemoryError, match=r"train\.offload_optimizer.*Ray's memory-monitor line") as e:
        off.offload()
    assert isinstance(e.value, VimeError) and "\n" not in str(e.value)
    assert not off.offloaded and off.arena.nbytes() == 0
    _step(ref_model, ref_opt, x)
    _step(model, opt, x)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
