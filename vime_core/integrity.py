"""Files on disk that can be trusted: checkpoint manifests, durable writes, free-space checks, and header checks of
HF safetensors weights, all without torch or actors.

A training checkpoint carries `manifest.json`: every file's relative path, size and CRC-32. CRC-32 (zlib) runs at
3.9 GB/s on one core here (sha256 1.6 GB/s, blake2b 0.9 GB/s, measured on 256 MiB): the tiny model's 5.8 MB
checkpoint takes 5-15 ms to sum and fsync at save and ~1.3 ms to verify at resume; an 8B model with its fp32
optimizer state (~100 GB) would take ~26 s of summing. It detects torn and damaged files, not tampering.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import zlib
from pathlib import Path

from vime_core.errors import DiskSpaceError, VimeError
from vime_core.fsutil import fsync_dir

MANIFEST = "manifest.json"
CHUNK = 8 * 2**20


class WeightsFileError(VimeError, ValueError):
    """A safetensors weights file is missing, truncated or corrupt; the message names the file."""


class OutputDirError(VimeError, PermissionError):
    """The output directory cannot be written; the message names it."""


# --------------------------------------------------------------------------------------------------------------------
# durable writes and manifests
# --------------------------------------------------------------------------------------------------------------------
def _sum_and_sync(path: Path) -> tuple[int, int]:
    """(size, crc32) of a file, fsynced while it is read (its pages are still cached from the write)."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
        os.fsync(fh.fileno())
    return size, crc


def write_manifest(root: Path) -> dict[str, list[int]]:
    """Sum and fsync every file under `root`, fsync every directory, write `root/manifest.json` (fsynced too).
    Called on a checkpoint's temporary dir before it is renamed into place, so a complete-looking checkpoint is
    complete on disk, also after a power loss."""
    files: dict[str, list[int]] = {}
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel != MANIFEST:
                files[rel] = list(_sum_and_sync(p))
        fsync_dir(Path(dirpath))
    manifest = root / MANIFEST
    with open(manifest, "w") as fh:
        json.dump({"format": "vime-manifest-1", "checksum": "crc32", "files": files}, fh, indent=0)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(root)
    return files


def manifest_problems(root: Path, full: bool = True) -> list[str]:
    """What is wrong with the files of `root` against its manifest ([] when intact). `full`: compare checksums too
    (reads every file), else sizes only."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return [f"{MANIFEST} is missing"]
    except (ValueError, KeyError, TypeError) as e:  # another OSError (EIO, EACCES) propagates: not proof of damage
        return [f"{MANIFEST} is unreadable ({type(e).__name__})"]
    problems = []
    for rel, (size, crc) in files.items():
        p = root / rel
        try:
            got = p.stat().st_size
            if got != size:
                problems.append(f"{rel} has {got:,} bytes, {size:,} were written")
            elif full and _sum(p) != crc:
                problems.append(f"{rel} is damaged (checksum mismatch)")
        except FileNotFoundError:
            problems.append(f"{rel} is missing")
        # any other OSError (EIO, EACCES, a stale NFS handle) propagates: the file may be intact, and the caller
        # must not set the checkpoint aside as damaged for it
    return problems


def _sum(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def manifest_bytes(root: Path) -> int | None:
    """Total size recorded in `root`'s manifest (None without one)."""
    try:
        return sum(size for size, _ in json.loads((root / MANIFEST).read_text())["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------------------------------------------------
# disk space
# --------------------------------------------------------------------------------------------------------------------
SPACE_MARGIN = 1.10  # a save may be a little larger than the last one (the step counter, the RNG states)


def gib(n: float) -> str:
    """Bytes for a message: GiB, or MiB below 1 GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def free_bytes(path: Path) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def is_disk_full(e: BaseException) -> bool:
    """An error (possibly from a Ray actor, possibly torch's) that means the disk is full. torch.save reports ENOSPC
    as `enforce fail at inline_container.cc ... unexpected pos` or `PytorchStreamWriter failed writing file`."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    cause = getattr(e, "cause", None)
    if cause is not None and cause is not e and is_disk_full(cause):
        return True
    text = str(e)
    return any(
        s in text for s in ("No space left on device", "unexpected pos", "failed writing file", "Disk quota exceeded")
    )


def disk_full_error(path: Path, need: int | None) -> DiskSpaceError:
    want = f"about {gib(need)} (the size of the last checkpoint)" if need else "space for the checkpoint"
    return DiskSpaceError(
        f"No space left on device while saving a checkpoint in {path}: it needs {want}, {gib(free_bytes(path))} "
        f"are free there. The earlier checkpoints are intact; free space there, move output_dir, or lower "
        f"checkpoint.keep_last, then run again to resume"
    )


# --------------------------------------------------------------------------------------------------------------------
# checks before any actor starts
# --------------------------------------------------------------------------------------------------------------------
def safetensors_problem(path: Path) -> str | None:
    """Read a safetensors file's header only (8-byte length, JSON) and compare the size it implies with the file's:
    a truncated or corrupt file is found in milliseconds instead of when a rank loads it minutes later."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"{path} is truncated ({size} bytes: not even a safetensors header)"
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):
                return f"{path} is not a valid safetensors file (header length {n:,} for a {size:,}-byte file)"
            header = json.loads(fh.read(n))
    except OSError as e:
        return f"{path} cannot be read: {e.strerror or e}"
    except (ValueError, UnicodeDecodeError):
        return f"{path} is corrupt (its safetensors header is not valid JSON)"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    want = 8 + n + max(ends, default=0)
    if size < want:
        return f"{path} is truncated: {size:,} bytes, its header describes {want:,}"
    return None


def check_weights(files: list[Path]) -> None:
    problems = [p for p in (safetensors_problem(f) for f in files) if p]
    if problems:
        raise WeightsFileError("; ".join(problems) + ". Download or convert the model again")


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in `files`, from their headers only (no weights read: milliseconds for an 8B
    model's 5 shards). For files `check_weights` passed."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def check_writable(path: Path, what: str = "output_dir") -> None:
    """`path` (created if absent) accepts a new file; raise OutputDirError naming it otherwise."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".vime-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutputDirError(
            f"{what} {path} is not writable ({e.strerror or e}); fix its permissions or choose another {what}"
        ) from None
