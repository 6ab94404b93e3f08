"""Megatron torch_dist checkpoints: the synchronous save, the strict load and its checks, and the `vime_meta.json`
written beside the weights (dtype, saved layout, source hash)."""

from __future__ import annotations

import contextlib
import json
import queue as queue_mod
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from vime_core.errors import VimeError
from vime_core.namediff import describe_name_diff, name_diff

META_FILE = "vime_meta.json"
HF_CONFIG_DIR = "hf_config"  # config + tokenizer kept next to torch_dist weights, for export without the source


class ConversionError(VimeError, RuntimeError):
    """A conversion failed; the message names the tensor, field or rank that failed."""


def save_torch_dist(sharded_state_dict: dict, out_dir: str | Path) -> None:
    """`dist_checkpointing.save` (synchronous, collective), written by this process tensor by tensor
    (`streamed_writes`), without the process megatron starts for its results.

    megatron's torch_dist writer reports its results through a `multiprocessing.Manager().Queue()` made with the
    *spawn* context on a process's first save: a fresh Python that imports torch, 1.5 s of the first save of the
    tiny model on this 2-core box (0.07 s for later ones; 0.10 s every time with the queue below). A synchronous save
    collects the results in this process, so an in-process queue carries them as well; the files and their fsyncs are
    megatron's own. Never use this for megatron's async save."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:  # megatron-core 0.16: created on first use
        filesystem_async._results_queue = queue_mod.Queue()
    with streamed_writes():
        dist_checkpointing.save(sharded_state_dict, str(out_dir))


@contextlib.contextmanager
def streamed_writes():
    """Within: megatron's torch_dist writer copies each device tensor to host memory as it writes it, in this process,
    so that a save holds a few tensors' host copies at a time (`vime_core.fit.staging_bytes`) instead of every weight
    of the rank.

    megatron stages all of a rank's tensors first (`preload_tensors`), then writes its files in forked workers, which
    cannot read device memory. Qwen3-8B's final save raised the host by its 15.3 GiB of bf16 weights (~21.5 GiB in
    torch's pinned blocks, each rounded up to a power of two): the run's host peak, near the line where Ray's memory
    monitor kills. A synchronous save gains nothing from staging ahead: it waits for the writes either way. Here the
    staging step hands the writer lazy copies (`HostCopies`), and megatron's own per-file writer writes each file in
    a thread of this process."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync as Writer

    preload, write = Writer.preload_tensors, Writer.write_preloaded_data_multiproc
    Writer.preload_tensors = staticmethod(defer_host_copies)
    Writer.write_preloaded_data_multiproc = staticmethod(write_in_process)
    try:
        yield
    finally:
        Writer.preload_tensors, Writer.write_preloaded_data_multiproc = staticmethod(preload), staticmethod(write)


class HostCopies:
    """A write bucket's (item, tensor) pairs, each tensor copied to pageable host memory when the writer reaches it
    (a no-op for host tensors). Pageable: torch's pinned allocator would round each copy up to a power of two and keep
    the blocks cached after the save."""

    def __init__(self, pairs: list):
        self.pairs = pairs

    def __iter__(self):
        for item, tensor in self.pairs:
            yield item, tensor.to("cpu")

    def __len__(self) -> int:
        return len(self.pairs)


def defer_host_copies(write_buckets: list, non_blocking: bool = True) -> list:
    """`preload_tensors`' place: the buckets with their tensors left where they are, copied as they are written."""
    return [(name, key, (data, HostCopies(tensors))) for name, key, (data, tensors) in write_buckets]


def write_in_process(transform_list: list, use_msc: bool, rank: int, write_buckets: list, results) -> None:
    """`write_preloaded_data_multiproc`'s place: megatron's per-file writer for each bucket (file), one thread each, in
    this process (which can read the device tensors); puts the same `{bucket index: write results}` (or the first
    exception) on `results`. Threads, as megatron's processes, so that one file's copies overlap another's writes."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync as Writer

    def write(i: int, bucket) -> object:
        local, done = queue_mod.Queue(), queue_mod.Queue()
        done.put(i)  # the per-file writer takes and acknowledges one token, as it does from megatron's count queue
        Writer.write_preloaded_data(transform_list, i, bucket, local, done, True, use_msc=use_msc)
        return local.get_nowait()[1]

    with ThreadPoolExecutor(max_workers=max(1, len(write_buckets))) as pool:
        outcomes = list(pool.map(write, range(len(write_buckets)), write_buckets))
    failed = [o for o in outcomes if isinstance(o, Exception)]
    results.put(failed[0] if failed else dict(enumerate(outcomes)))


def write_torch_dist_meta(
    ckpt_dir: Path,
    *,
    dtype: str,
    source: str | Path,
    layout: tuple[int, int, int],
    source_hash: str | None = None,
    arch: dict | None = None,
) -> None:
    """The one writer of `vime_meta.json` beside torch_dist weights, for a conversion and a training checkpoint
    alike: the dtype and config source `vime convert megatron-to-hf` exports with, the layout it was saved at, and
    (conversions only; null otherwise) the source's content hash that `is_converted` compares and its architecture."""
    tp, pp, ep = layout
    meta = {
        "format": "torch_dist",
        "source": str(source),
        "source_hash": source_hash,
        "dtype": dtype,
        "saved_layout": {"tp": tp, "pp": pp, "ep": ep},
        "arch": arch,
    }
    (Path(ckpt_dir) / META_FILE).write_text(json.dumps(meta, indent=2))


def converted_meta(ckpt_dir: str | Path) -> dict | None:
    p = Path(ckpt_dir) / META_FILE
    return json.loads(p.read_text()) if p.is_file() else None


def is_converted(out: str | Path, source_hash: str, dtype: str) -> bool:
    """`out` already holds a conversion of the checkpoint with this content hash, at this dtype."""
    meta = converted_meta(out) or {}
    return meta.get("source_hash") == source_hash and meta.get("dtype") == dtype


def check_torch_dist_matches(ckpt_dir: str | Path, model) -> None:
    """Compare the checkpoint's tensors (names, global shapes) with what `model` expects; raise naming them."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    saved = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    expected: dict[str, tuple] = {}
    sharded, _ = extract_sharded_tensors_and_factories(model.sharded_state_dict())

    def walk(x):
        if isinstance(x, ShardedTensor):
            expected[x.key] = tuple(x.global_shape)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "build"):  # ShardedTensorFactory: its key is what the checkpoint holds
            expected.setdefault(x.key, None)

    walk(sharded)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:  # pipeline stages hold different tensors: use the union
        views: list = [None] * dist.get_world_size()
        dist.all_gather_object(views, expected)
        for view in views:
            for k, shape in view.items():
                if expected.get(k) is None:
                    expected[k] = shape
    missing, unexpected = name_diff(expected, saved)
    wrong = [
        f"{k}: checkpoint {tuple(saved[k].global_shape)} vs model {expected[k]}"
        for k in expected
        if k in saved and expected[k] is not None and tuple(saved[k].global_shape) != expected[k]
    ]
    if missing or unexpected or wrong:
        parts = [describe_name_diff(missing, unexpected)] if missing or unexpected else []
        if wrong:
            parts.append(f"shape mismatch: {wrong[:4]}")
        raise ConversionError(f"torch_dist checkpoint {ckpt_dir} does not match the model: " + "; ".join(parts))


def load_torch_dist(model, ckpt_dir: str | Path) -> None:
    """A torch_dist checkpoint (any saved layout) into this rank's shards of `model`, strictly: checked against
    the model first, then a weight the load left unset or could not place raises (a lenient load would export or
    train that weight at its random initialisation, silently)."""
    from megatron.core import dist_checkpointing

    check_torch_dist_matches(ckpt_dir, model)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    check_loaded(ckpt_dir, missing, unexpected)


def check_loaded(ckpt_dir: str | Path, missing: list[str], unexpected: list[str]) -> None:
    """Raise ConversionError naming what `load_state_dict(strict=False)` reported, except megatron's
    `_extra_state` entries (bookkeeping that torch_dist does not store; not weights)."""
    missing = sorted(m for m in missing if not m.endswith("_extra_state"))
    if missing or unexpected:
        raise ConversionError(
            f"torch_dist checkpoint {ckpt_dir} does not fit the model: "
            + describe_name_diff(missing, sorted(unexpected))
        )


def read_torch_dist_tensors(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, unsharded, without a process group (for inspection and tests)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "all.pt"
        dcp_to_torch_save(str(ckpt_dir), str(out))
        blob = torch.load(out, weights_only=False)
    return {k: v for k, v in blob.items() if isinstance(v, torch.Tensor)}
