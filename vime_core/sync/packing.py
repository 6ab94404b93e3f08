"""Bucket packing, pure torch (no engine, no process group): HF-named tensors are copied into one contiguous uint8
buffer per bucket, described by a layout that the engine side turns back into views. Tested on CPU
(tests/unit/test_sync_units.py); the GPU transports move the same buffers."""

from __future__ import annotations

from typing import Iterable

import torch

# (name, shape, dtype as str(torch.dtype), byte offset) of every tensor in a bucket
Layout = list[tuple[str, tuple[int, ...], str, int]]

DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def view(bucket: torch.Tensor, shape: tuple[int, ...], dtype: str, offset: int) -> torch.Tensor:
    """The tensor of `shape` and `dtype` at byte `offset` of `bucket`, as a view (no copy)."""
    dt = DTYPES[dtype]
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dt).element_size()
    return bucket[offset : offset + nbytes].view(dt).view(shape)


def unpack(bucket: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of every tensor `layout` places in `bucket`."""
    return [(name, view(bucket, shape, dtype, offset)) for name, shape, dtype, offset in layout]


def pack_bucket(tensors: list[tuple[str, torch.Tensor]], device: torch.device | str) -> tuple[torch.Tensor, Layout]:
    """Copy tensors into one contiguous uint8 buffer (each aligned to 256 bytes); returns (buffer, layout)."""
    layout, offset = [], 0
    prepared = []
    for name, t in tensors:
        offset = (offset + 255) // 256 * 256
        layout.append((name, tuple(t.shape), str(t.dtype), offset))
        prepared.append((t, offset))
        offset += t.numel() * t.element_size()
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    for t, off in prepared:
        n = t.numel() * t.element_size()
        buf[off : off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    return buf, layout


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of `named` of at most `max_bytes` each (a tensor larger than that is a bucket alone)."""
    cur, size = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and size + n > max_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur
