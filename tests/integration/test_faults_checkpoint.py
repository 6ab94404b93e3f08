"""A real full disk: torch.save into a 1 MiB tmpfs (needs mount rights; skipped elsewhere) is translated to a
DiskSpaceError naming the directory. The other checkpoint faults: tests/unit/test_faults_checkpoint.py."""

from __future__ import annotations

import pytest

from vime_core.checkpoint import Checkpointer
from vime_core.errors import DiskSpaceError


def test_a_real_enospc_from_torch_save_is_translated(tmp_path):
    """torch.save into a 1 MiB tmpfs (needs mount rights; skipped elsewhere): the real 'unexpected pos' failure."""
    import subprocess

    import torch

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        ckpt = Checkpointer(mnt / "c")
        tmp = ckpt.begin(0)
        with pytest.raises(DiskSpaceError) as e:
            with ckpt.writing(tmp):
                torch.save({"w": torch.zeros(2**20)}, tmp / "rank_00000.pt")  # 4 MiB
        assert "No space left on device" in str(e.value) and str(mnt / "c") in str(e.value)
        assert e.value.__cause__ is not None
    finally:
        # lazy: `e` still holds torch.save's open file, so a plain umount fails (EBUSY) and left the tmpfs mounted
        subprocess.run(["umount", "--lazy", str(mnt)], capture_output=True)
