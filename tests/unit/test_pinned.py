"""vime_core.pinned: host buffers carved from power-of-two slabs (unpinned on CPU; the packing is the same)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vime_core.pinned import ALIGN, HostMemoryError, PinnedArena, pow2_ceil

KIB = 1024


def test_buffers_have_their_shapes_and_dtypes_and_do_not_overlap():
    arena = PinnedArena(pin=False, slab_bytes=64 * KIB)
    specs = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((), torch.float32), ((0, 4), torch.float32)]
    specs += [((2048,), torch.float32)] * 3  # 8 KiB each
    bufs = arena.take(specs)
    assert [(tuple(b.shape), b.dtype) for b in bufs] == [(tuple(s), d) for s, d in specs]
    for i, b in enumerate(bufs):
        b.fill_(i + 1)
    for i, b in enumerate(bufs):  # a buffer sharing bytes with another would read the later fill
        assert torch.all(b == i + 1)
    # offsets into the slab (a pinned slab starts on a page; a CPU tensor on 64 bytes)
    assert all((b.data_ptr() - b.untyped_storage().data_ptr()) % ALIGN == 0 for b in bufs if b.numel())


def test_every_slab_is_a_power_of_two_and_little_is_left_unused():
    # the shapes of Qwen3-30B-A3B's grouped experts, scaled down: 1.5 and 0.75 units, three tensors each
    unit = 64 * KIB
    specs = [((3 * unit // 8,), torch.float32)] * 30 + [((3 * unit // 16,), torch.float32)] * 30
    asked = sum(3 * unit // 2 for _ in range(30)) + sum(3 * unit // 4 for _ in range(30))
    arena = PinnedArena(pin=False, slab_bytes=8 * unit)
    arena.take(specs)
    # what torch's pinned allocator would hold, one buffer per tensor rounded up to a power of two
    rounded = sum(pow2_ceil(3 * unit // 2) for _ in range(30)) + sum(pow2_ceil(3 * unit // 4) for _ in range(30))
    assert all(s.numel() == pow2_ceil(s.numel()) for s in arena.slabs)
    assert arena.nbytes() < 1.10 * asked < rounded


def test_later_takes_fill_the_room_left_in_earlier_slabs():
    arena = PinnedArena(pin=False, slab_bytes=16 * KIB)
    arena.take([((3 * KIB,), torch.float32)])  # 12 KiB, alone: a 16 KiB slab (the smallest that holds it)
    assert arena.nbytes() == 16 * KIB
    arena.take([((KIB // 2,), torch.float32)])  # 2 KiB fits in the first slab's last 4 KiB
    assert len(arena.slabs) == 1
    arena.take([((KIB,), torch.float32)])  # 4 KiB does not (2 KiB left): a new slab of 4 KiB
    assert [s.numel() for s in arena.slabs] == [16 * KIB, 4 * KIB]


def test_a_tensor_larger_than_a_slab_gets_a_slab_of_its_own():
    arena = PinnedArena(pin=False, slab_bytes=4 * KIB)
    (big,) = arena.take([((3 * KIB,), torch.float32)])  # 12 KiB
    assert big.numel() == 3 * KIB and arena.nbytes() == 16 * KIB


def test_slab_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        PinnedArena(pin=False, slab_bytes=3 * KIB)


def test_a_slab_past_the_hosts_room_is_refused_before_it_is_pinned():
    room = {"bytes": 20 * KIB}
    arena = PinnedArena(pin=False, slab_bytes=16 * KIB, room=lambda: room["bytes"], what="the offload", fix="do X")
    arena.take([((3 * KIB,), torch.float32)])  # a 16 KiB slab: within the 20 KiB of room
    room["bytes"] = 4 * KIB  # what the host has left after it
    with pytest.raises(
        HostMemoryError, match=r"^the offload: pinning another 0\.0 GiB .* Ray's memory-monitor .*: do X$"
    ):
        arena.take([((2 * KIB,), torch.float32)])  # 8 KiB more: refused, nothing allocated
    assert arena.nbytes() == 16 * KIB


def test_host_room_is_what_stays_below_rays_line(monkeypatch):
    import psutil

    from vime_core import platform

    gib = 2**30
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=100 * gib, available=20 * gib))
    # Ray kills above 95 of 100 GiB used; 80 are used; 1 GiB stays for the other processes
    assert platform.host_room_bytes() == 14 * gib


def test_reserved_slabs_take_the_buffers_they_were_pinned_for_and_no_more_slabs():
    unit = 64 * KIB
    sizes = [3 * unit // 2] * 6 + [3 * unit // 4] * 6 + [4] * 5  # expert-like tensors and fused Adam's steps
    arena = PinnedArena(pin=False, slab_bytes=8 * unit)
    arena.reserve(sizes)
    reserved = [s.numel() for s in arena.slabs]
    assert sum(reserved) >= sum(sizes) and arena.used == [0] * len(reserved)
    bufs = arena.take([((n // 4,), torch.float32) if n > 4 else ((), torch.float32) for n in sizes])
    assert [s.numel() for s in arena.slabs] == reserved  # the same placement fills them: no slab added
    assert sum(b.numel() * b.element_size() for b in bufs) == sum(sizes)
