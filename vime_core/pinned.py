"""Pinned host buffers packed into slabs whose sizes are powers of two.

torch's pinned-memory allocator (its CachingHostAllocator) rounds every allocation up to the next power of two so
that freed blocks can be reused. On the H200 machine (torch 2.11) a 1.5 GiB pinned tensor raised the process's
resident memory by 2.09 GiB, and the setting that turns the rounding off (`pinned_max_round_threshold_mb`) is newer
than torch 2.11 there ("Unrecognized key"). One pinned buffer per optimizer tensor therefore pins up to twice what it
holds: the fp32 grouped-expert tensors of Qwen3-30B-A3B are 1.5 and 0.75 GiB each, and with the optimizer state of its
first ten layers (76.6 GiB) offloaded that way the trainer reached 112.6 GiB resident and Ray's memory monitor killed
it in its first checkpoint save.

`PinnedArena` asks the allocator only for power-of-two slabs (so nothing is rounded) and carves the buffers out of
them, largest first into the first slab with room (first-fit decreasing); a new slab is the largest power of two that
the bytes still to place fill, capped at `SLAB_BYTES`, so the last one is not mostly empty either. The slabs live as
long as the arena: buffers are kept across steps anyway, since pinning is slow. `reserve` pins the slabs ahead of
time (while the rank is idle) without carving them: the buffers are cut when the real tensors are known, so a
forecast that got a shape, a dtype or a count wrong costs no second copy.

Pinned pages cannot be swapped or reclaimed, and Ray's memory monitor kills the largest worker once the host passes
its threshold (the 30B-A3B loop: "4 worker(s) were killed", the trainer at 112 GiB, with nothing saying why). With a
`room` function the arena refuses a slab that would take the host past that line and raises HostMemoryError, which
names the sizes and the setting, before it pins anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from vime_core.errors import VimeError

ALIGN = 512  # offset of every buffer in its slab (pinned slabs start on a page): any dtype's alignment
SLAB_BYTES = 8 << 30  # pinned at once in the background; large enough that 1.5 GiB tensors waste < 7% of a slab


def pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def buffer_bytes(shape, dtype: torch.dtype) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * torch.empty((), dtype=dtype).element_size()


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostMemoryError(VimeError, MemoryError):
    """Pinning more host memory would take the host past Ray's memory-monitor line; the message names the setting."""


class PinnedArena:
    """Host buffers as views into power-of-two slabs (see the module doc); plain host memory where `pin` is False
    (CPU runs and tests), packed the same way."""

    def __init__(
        self,
        pin: bool,
        slab_bytes: int = SLAB_BYTES,
        room: Callable[[], int] | None = None,
        what: str = "host buffers",
        fix: str = "give the host more memory",
    ):
        """`room`: bytes the host can still give (see `vime_core.platform.host_room_bytes`), asked before each new
        slab; `what` (the buffers' purpose) and `fix` (the setting to change) make HostMemoryError's message."""
        if slab_bytes != pow2_ceil(slab_bytes):
            raise ValueError(f"slab_bytes must be a power of two, got {slab_bytes}")
        self.pin, self.slab_bytes, self.room, self.what, self.fix = pin, slab_bytes, room, what, fix
        self.slabs: list[torch.Tensor] = []  # uint8, each a power of two long
        self.used: list[int] = []  # bytes handed out from the start of each slab
        self.lock = threading.Lock()  # pre-pinning fills the arena from a background thread

    def nbytes(self) -> int:
        """Bytes held (pinned where `pin`): what the process's resident memory grows by."""
        return sum(s.numel() for s in self.slabs)

    def take(self, specs: list[tuple[torch.Size | tuple, torch.dtype]]) -> list[torch.Tensor]:
        """One new buffer per (shape, dtype) of `specs`, in their order; placed largest first."""
        with self.lock:
            raws = self.place_all([buffer_bytes(shape, dtype) for shape, dtype in specs])
        return [typed(raw, shape, dtype) for raw, (shape, dtype) in zip(raws, specs)]

    def reserve(self, sizes: list[int]) -> None:
        """Pin the slabs that buffers of `sizes` would take, and hand none out: a later `take` of those sizes fills
        them exactly (the same largest-first placement), one of other sizes fills what room they have."""
        with self.lock:
            used = list(self.used)
            self.place_all(sizes)
            self.used = used + [0] * (len(self.slabs) - len(used))

    def place_all(self, sizes: list[int]) -> list[torch.Tensor]:
        """A uint8 buffer of each of `sizes` bytes, in their order, placed largest first; the caller holds the lock."""
        out: list[torch.Tensor | None] = [None] * len(sizes)
        left = sum(aligned(n) for n in sizes)
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            if sizes[i] == 0:
                out[i] = torch.empty(0, dtype=torch.uint8)
                continue
            slab, start = self.place(aligned(sizes[i]), left)
            left -= aligned(sizes[i])
            out[i] = self.slabs[slab][start : start + sizes[i]]
        return out  # type: ignore[return-value]

    def place(self, n: int, left: int) -> tuple[int, int]:
        """(slab index, offset) of `n` bytes: the first slab with room at its end, else a new slab sized for the
        `left` bytes still to place (this `n` among them), at least `n` and at most `slab_bytes` unless `n` is more."""
        for k, slab in enumerate(self.slabs):
            if slab.numel() - self.used[k] >= n:
                start = self.used[k]
                self.used[k] += n
                return k, start
        size = max(pow2_ceil(n), min(self.slab_bytes, pow2_floor(left)))
        if self.room is not None:
            self.check_room(size)
        self.slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
        self.used.append(n)
        return len(self.slabs) - 1, 0

    def check_room(self, size: int) -> None:
        room = self.room()  # type: ignore[misc]
        if size > room:
            raise HostMemoryError(
                f"{self.what}: pinning another {size / 2**30:.1f} GiB (after {self.nbytes() / 2**30:.1f} GiB) "
                f"would take the host past Ray's memory-monitor line ({max(room, 0) / 2**30:.1f} GiB left below "
                f"it), and Ray would kill the process: {self.fix}"
            )


def typed(raw: torch.Tensor, shape: torch.Size | tuple, dtype: torch.dtype) -> torch.Tensor:
    """The first bytes of the uint8 buffer `raw` as a tensor of `shape` and `dtype` (no copy)."""
    n = buffer_bytes(shape, dtype)
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return raw[:n].view(dtype).view(shape)
