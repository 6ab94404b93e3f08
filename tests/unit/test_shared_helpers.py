"""The one home of each small helper that used to be written several times: atomic writes, name diffs, the strict
torch_dist load check, free ports, the vime_meta.json writer."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from vime_core.checkpoint import (
    META_FILE,
    ConversionError,
    check_loaded,
    converted_meta,
    is_converted,
    write_torch_dist_meta,
)
from vime_core.fsutil import atomic_write_text, replacing_dir, tmp_sibling
from vime_core.namediff import describe_name_diff, name_diff
from vime_core.ports import free_port


def test_atomic_write_replaces_the_text_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "latest"
    atomic_write_text(path, "iter_1")
    atomic_write_text(path, "iter_2", durable=False)
    assert path.read_text() == "iter_2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_failed_directory_write_keeps_the_old_directory(tmp_path):
    target = tmp_path / "export"
    with replacing_dir(target) as tmp:
        (tmp / "a").write_text("first")
    with pytest.raises(RuntimeError, match="killed mid-write"):
        with replacing_dir(target) as tmp:
            (tmp / "a").write_text("torn")
            raise RuntimeError("killed mid-write")
    assert (target / "a").read_text() == "first"
    assert not tmp_sibling(target).exists()
    with replacing_dir(target) as tmp:
        (tmp / "b").write_text("second")
    assert sorted(p.name for p in target.iterdir()) == ["b"], "the new directory replaces the old one whole"


def test_name_diff_says_what_is_missing_and_what_is_extra():
    missing, unexpected = name_diff(["a", "b", "c"], ["c", "d", "lm_head.weight"], allowed_extra=["lm_head.weight"])
    assert (missing, unexpected) == (["a", "b"], ["d"])
    assert describe_name_diff(missing, unexpected) == "missing 2 tensor(s): a, b; unexpected 1 tensor(s): d"
    assert describe_name_diff([f"w{i}" for i in range(8)], [], limit=2) == "missing 8 tensor(s): w0, w1 ..."
    assert describe_name_diff([], []) == ""


def test_a_torch_dist_load_that_leaves_a_weight_unset_is_refused():
    """The converter used to ignore what `load_state_dict(strict=False)` reported: a weight left at its random
    initialisation would have been exported silently. Now every load is strict but for megatron's _extra_state."""
    model = torch.nn.Linear(2, 2)
    missing, unexpected = model.load_state_dict({"weight": torch.zeros(2, 2), "extra": torch.zeros(1)}, strict=False)
    with pytest.raises(
        ConversionError,
        match=r"ckpt/iter_3 does not fit the model: missing 1 tensor\(s\): bias; "
        r"unexpected 1 tensor\(s\): extra",
    ):
        check_loaded("ckpt/iter_3", missing, unexpected)
    check_loaded("ckpt/iter_3", ["decoder.layers.0.self_attention._extra_state"], [])  # bookkeeping only: loads


def test_one_meta_schema_for_conversions_and_training_checkpoints(tmp_path):
    conv, train = tmp_path / "conv", tmp_path / "iter_0000001"
    conv.mkdir()
    train.mkdir()
    write_torch_dist_meta(
        conv, dtype="float32", source="/m", layout=(2, 1, 1), source_hash="abc", arch={"num_layers": 2}
    )
    write_torch_dist_meta(train, dtype="bfloat16", source="/m", layout=(1, 1, 2))
    a, b = converted_meta(conv), json.loads((train / META_FILE).read_text())
    assert a.keys() == b.keys()
    assert b["saved_layout"] == {"tp": 1, "pp": 1, "ep": 2} and b["source_hash"] is None
    assert is_converted(conv, "abc", "float32") and not is_converted(train, "abc", "bfloat16")


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        assert s.getsockname()[1] == port
