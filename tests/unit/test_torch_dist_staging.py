"""A checkpoint save copies each device tensor to host memory as it writes it, in the saving process
(checkpoint.torch_dist.streamed_writes): megatron's writer would stage every weight of the rank first, pinned."""

from __future__ import annotations

import gc
import queue
import weakref

import pytest
import torch

from vime_core.checkpoint.torch_dist import HostCopies, defer_host_copies, streamed_writes, write_in_process


class DeviceTensor:
    """Stands in for a device tensor in megatron's write bucket: records how it is copied and tracks its copies."""

    def __init__(self, n: int):
        self.n, self.copies, self.alive = n, [], []

    def to(self, device, non_blocking=False):
        copy = torch.zeros(self.n)
        self.copies.append((device, non_blocking))
        self.alive.append(weakref.ref(copy))
        return copy


def test_each_tensor_is_copied_pageable_when_reached_and_dropped_before_the_one_after_next():
    tensors = [DeviceTensor(4) for _ in range(4)]
    ((name, key, (data, lazy)),) = defer_host_copies([("file", "key", (["bytes"], list(enumerate(tensors))))])
    assert (name, key, data, len(lazy)) == ("file", "key", ["bytes"], 4) and isinstance(lazy, HostCopies)
    assert all(t.copies == [] for t in tensors)  # nothing staged ahead of the writes
    for i, (item, copy) in enumerate(lazy):
        assert item == i and copy.is_cpu and tensors[i].copies == [("cpu", False)]
        gc.collect()
        # at most this copy and the one the consumer's loop variable held until now
        assert all(t.alive[0]() is None for t in tensors[: max(0, i - 1)])
    del copy


def test_the_writers_are_swapped_within_and_restored_after_a_failed_save():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync as Writer

    originals = (Writer.preload_tensors, Writer.write_preloaded_data_multiproc)
    with streamed_writes():
        assert (Writer.preload_tensors, Writer.write_preloaded_data_multiproc) == (defer_host_copies, write_in_process)
    with pytest.raises(OSError), streamed_writes():
        raise OSError("disk full")
    assert (Writer.preload_tensors, Writer.write_preloaded_data_multiproc) == originals


def test_a_write_failure_is_put_on_the_results_queue(tmp_path):
    results = queue.Queue()
    bucket = (str(tmp_path / "missing-dir" / "0.distcp"), "0.distcp", ([], []))  # its directory does not exist
    write_in_process([], False, 0, [bucket], results)
    assert isinstance(results.get_nowait(), FileNotFoundError)
