"""Run a test helper function as `world` fresh gloo ranks (torch.multiprocessing spawn): the one launcher behind
tests/helpers/megatron_ranks.py and tests/helpers/trainer_ranks.py. The function lives in an importable module so that
spawn can start it; it runs as `fn(rank, world, port, *args)` and returns plain objects (floats, lists, numpy arrays),
never tensors."""

from __future__ import annotations

import importlib
import queue as queue_mod
import time
import traceback
from vime_core.ports import free_port


def spawn_ranks(module: str, fn_name: str, world: int, *args, timeout: float = 300.0) -> list:
    """`<module>.<fn_name>(rank, world, port, *args)` in `world` spawned processes; their return values in rank
    order. A rank's exception is raised here with its traceback; dead or hung ranks raise after `timeout`."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(module, fn_name, r, world, port, q, args)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, ok, payload = q.get(timeout=2)
            except queue_mod.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{fn_name}: ranks died or timed out (exit codes {[p.exitcode for p in procs]})"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"{fn_name}: rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world else 2)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _entry(module: str, fn_name: str, rank: int, world: int, port: int, q, args: tuple) -> None:
    try:
        q.put((rank, True, getattr(importlib.import_module(module), fn_name)(rank, world, port, *args)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))
