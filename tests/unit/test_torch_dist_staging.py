"""A checkpoint save stages device tensors in pageable host memory (checkpoint.torch_dist.pageable_staging): torch's
pinned allocator would round each one up to a power of two and keep the blocks after the save."""

from __future__ import annotations

import pytest

from vime_core.checkpoint.torch_dist import pageable_staging


class RecordingTensor:
    """Stands in for a device tensor in megatron's write bucket: records how the writer copies it to the host."""

    def __init__(self):
        self.copies = []

    def to(self, device, non_blocking=False):
        self.copies.append((device, non_blocking))
        return self


def test_the_writer_copies_each_tensor_without_pinning_within_and_is_restored_after():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.preload_tensors
    t = RecordingTensor()
    with pageable_staging():
        staged = FileSystemWriterAsync.preload_tensors([("file", "key", ([], [("item", t)]))], True)
    assert t.copies == [("cpu", False)]  # asked for non_blocking=True, as megatron's save does: copied pageable
    assert staged == [("file", "key", ([], [("item", t)]))]
    assert FileSystemWriterAsync.preload_tensors is original


def test_the_writer_is_restored_when_the_save_fails():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.preload_tensors
    with pytest.raises(OSError), pageable_staging():
        raise OSError("disk full")
    assert FileSystemWriterAsync.preload_tensors is original
