"""Writes that are complete or absent: a temporary sibling, then one rename. No vime_core imports, so everything that
writes a file or a directory others read (checkpoints, exports, builtin models, the nightly candidate) uses it."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def tmp_sibling(path: Path) -> Path:
    """`<name>.tmp-<pid>` beside `path`: on the same filesystem (so the rename is atomic), and per process (two
    writers never share one)."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (the directory entry, not only the data)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    """`path` holds the old text or the new one, never a torn file (a kill mid-write leaves only the temporary).
    `durable`: fsync the file and the directory too, so that a power loss keeps the new text."""
    path = Path(path)
    tmp = tmp_sibling(path)
    with open(tmp, "w") as fh:
        fh.write(text)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


@contextmanager
def replacing_dir(target: Path) -> Iterator[Path]:
    """Yield a fresh temporary sibling directory to fill; when the block succeeds it replaces `target` (an earlier
    one is removed first), when it fails it is removed: `target` is complete or as it was."""
    target = Path(target)
    tmp = tmp_sibling(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
