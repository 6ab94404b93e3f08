"""Unit tests of vime_core.data: reading and validating prompt datasets, builtin://arith, and the DataBuffer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from vime_core.builtin import all_problems, build_tokenizer, problems
from vime_core.config import DataConfig
from vime_core.data import DataBuffer, DatasetError, Prompt, PromptSet, load_prompts, read_rows

GOOD_CHAT = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "label": "5"}
GOOD_TEXT = {"prompt": "Compute 4 * 6.", "label": 24}
LONG_PROMPT = "word " * 100  # ~500 tokens with this tokenizer, far above max_prompt_len = 64


@pytest.fixture(scope="session")
def tok():
    # the builtin byte-level BPE with the Qwen chat template (about a second to train)
    return build_tokenizer(384)


@pytest.fixture
def cfg() -> DataConfig:
    return DataConfig(max_prompt_len=64)


def _jsonl(path: Path, rows: list) -> Path:
    """Write rows (dicts are JSON-encoded, str/bytes written as they are) one per line."""
    lines = [r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode() for r in rows]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


# --------------------------------------------------------------------------------------------------------------------
# good files
# --------------------------------------------------------------------------------------------------------------------
def test_load_jsonl_chat_and_text_prompts(tmp_path, tok, cfg):
    f = _jsonl(
        tmp_path / "d.jsonl",
        [
            GOOD_CHAT,
            GOOD_TEXT,
            {"prompt": "Half of 5?", "label": 2.5, "metadata": {"src": "x"}},
            {"prompt": "Two?", "label": 2.0},
        ],
    )
    ps = load_prompts(str(f), tok, cfg)
    assert len(ps) == 4 and ps.skipped == 0 and ps.source == str(f)
    assert all(p.prompt_ids for p in ps.prompts)
    assert [p.index for p in ps.prompts] == [0, 1, 2, 3]
    assert [p.label for p in ps.prompts] == ["5", "24", "2.5", "2"]  # numbers become text; 2.0 -> "2"
    # chat template applied to both forms: a plain string becomes one user turn
    assert ps.prompts[0].prompt == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert ps.prompts[1].prompt == "<|im_start|>user\nCompute 4 * 6.<|im_end|>\n<|im_start|>assistant\n"
    assert ps.prompts[0].prompt_ids == tok(ps.prompts[0].prompt, add_special_tokens=False)["input_ids"]
    assert ps.prompts[2].metadata == {"src": "x"}
    s = ps.prompts[2].template(group_id=7)
    assert (s.group_id, s.label, s.prompt_ids, s.metadata) == (
        7,
        "2.5",
        ps.prompts[2].prompt_ids,
        {"src": "x", "index": 2},
    )


def test_load_without_chat_template(tmp_path, tok):
    f = _jsonl(tmp_path / "d.jsonl", [GOOD_CHAT, GOOD_TEXT])
    ps = load_prompts(str(f), tok, DataConfig(apply_chat_template=False))
    assert [p.prompt for p in ps.prompts] == ["What is 2 + 3?", "Compute 4 * 6."]


def test_load_parquet(tmp_path, tok, cfg):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "label": "5"},
                {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "label": "2"},
            ]
        ),
        f,
    )
    ps = load_prompts(str(f), tok, cfg)
    assert [p.label for p in ps.prompts] == ["5", "2"]
    assert ps.prompts[1].prompt == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert all(p.prompt_ids for p in ps.prompts)


def test_load_json_array(tmp_path, tok, cfg):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([GOOD_CHAT, GOOD_TEXT]))
    assert [p.label for p in load_prompts(str(f), tok, cfg).prompts] == ["5", "24"]


def test_load_directory_numbers_rows_across_files(tmp_path, tok, cfg):
    d = tmp_path / "ds"
    d.mkdir()
    _jsonl(d / "a.jsonl", [GOOD_CHAT, GOOD_TEXT, GOOD_CHAT])
    _jsonl(d / "b.jsonl", [{"prompt": "b1", "label": "1"}, {"prompt": "b2", "label": "2"}])
    assert [n for n, _ in read_rows(str(d))] == [1, 2, 3, 4, 5]
    ps = load_prompts(str(d), tok, cfg)
    assert [p.index for p in ps.prompts] == [0, 1, 2, 3, 4]  # unique, stable indices
    assert [p.label for p in ps.prompts] == ["5", "24", "5", "1", "2"]


def test_blank_lines_are_ignored_and_rows_keep_their_line_numbers(tmp_path, tok, cfg):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(GOOD_CHAT) + "\n\n   \n" + json.dumps(GOOD_TEXT) + "\n")
    ps = load_prompts(str(f), tok, cfg)
    assert [p.index for p in ps.prompts] == [0, 3]  # lines 1 and 4


def test_max_prompts_and_missing_label_allowed(tmp_path, tok, cfg):
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "c"}])
    ps = load_prompts(str(f), tok, cfg, max_prompts=2, require_label=False)
    assert len(ps) == 2 and [p.label for p in ps.prompts] == [None, None]


# --------------------------------------------------------------------------------------------------------------------
# bad rows
# --------------------------------------------------------------------------------------------------------------------
BAD_ROWS = {
    "no prompt key": ({"question": "What?", "label": "1"}, "no 'prompt' key (data.prompt_key)"),
    "no label key": ({"prompt": "What?", "answer": "1"}, "no 'label' key (data.label_key)"),
    "non-utf8": (b'{"prompt": "caf\xe9", "label": "1"}', "line is not valid UTF-8"),
    "bad json": ('{"prompt": "What?", "label": ', "not valid JSON"),
    "label dict": ({"prompt": "What?", "label": {"a": 1}}, "label must be text or a number, got dict"),
    "label list": ({"prompt": "What?", "label": [1, 2]}, "label must be text or a number, got list"),
    "label None": ({"prompt": "What?", "label": None}, "label None is not an answer"),
    "label bool": ({"prompt": "What?", "label": True}, "label True is not an answer"),
    "empty label": ({"prompt": "What?", "label": "  "}, "label is empty"),
    "empty prompt": ({"prompt": " ", "label": "1"}, "prompt is empty"),
    "bad message": (
        {"prompt": [{"role": "user"}], "label": "1"},
        "prompt message 0 must be an object with 'role' and 'content'",
    ),
    "row not an object": ([1, 2], "row must be an object, got list"),
    "too long": ({"prompt": LONG_PROMPT, "label": "1"}, "tokens, more than data.max_prompt_len = 64"),
}


def _row_ref(path: Path, row: int, raw) -> str:
    """How the message refers to the row: `path:N:` for read errors (JSON, bytes), `path: row N:` otherwise."""
    return f"{path}:{row}:" if isinstance(raw, (bytes, str)) else f"{path}: row {row}:"


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_row_raises_with_file_row_and_problem(tmp_path, tok, cfg, case):
    raw, problem = BAD_ROWS[case]
    f = _jsonl(tmp_path / "d.jsonl", [GOOD_CHAT, GOOD_TEXT, raw, GOOD_CHAT])  # the bad row is row 3
    with pytest.raises(DatasetError) as ei:
        load_prompts(str(f), tok, cfg)
    msg = str(ei.value)
    assert _row_ref(f, 3, raw) in msg
    assert problem in msg
    assert "data.bad_rows=skip" in msg  # and how to go on anyway


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_row_skipped_and_counted(tmp_path, tok, cfg, case, caplog):
    raw, problem = BAD_ROWS[case]
    f = _jsonl(tmp_path / "d.jsonl", [GOOD_CHAT, raw, GOOD_TEXT, raw, GOOD_CHAT])  # bad rows 2 and 4
    skip = cfg.model_copy(update={"bad_rows": "skip"})
    with caplog.at_level(logging.WARNING, logger="vime_core.data"):
        ps = load_prompts(str(f), tok, skip)
    assert ps.skipped == 2
    assert [p.index for p in ps.prompts] == [0, 2, 4]
    assert [p.label for p in ps.prompts] == ["5", "24", "5"]
    assert len(ps.skipped_reasons) == 2
    assert _row_ref(f, 2, raw) in ps.skipped_reasons[0] and problem in ps.skipped_reasons[0]
    assert _row_ref(f, 4, raw) in ps.skipped_reasons[1]
    assert "skipped 2 bad row(s)" in caplog.text


def test_all_rows_bad_with_skip_raises(tmp_path, tok, cfg):
    f = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": None}, "{oops", {"label": "1"}])
    with pytest.raises(DatasetError) as ei:
        load_prompts(str(f), tok, cfg.model_copy(update={"bad_rows": "skip"}))
    msg = str(ei.value)
    assert str(f) in msg and "has no usable rows (3 skipped" in msg


# --------------------------------------------------------------------------------------------------------------------
# bad files
# --------------------------------------------------------------------------------------------------------------------
def test_empty_file(tmp_path, tok, cfg):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b"")
    with pytest.raises(DatasetError, match=rf"dataset {f} is empty"):
        load_prompts(str(f), tok, cfg)


def test_only_blank_lines(tmp_path, tok, cfg):
    f = tmp_path / "d.jsonl"
    f.write_text("\n  \n\t\n")
    with pytest.raises(DatasetError, match=rf"dataset {f} has no rows \(only blank lines\)"):
        load_prompts(str(f), tok, cfg)


def test_unsupported_suffix(tmp_path, tok, cfg):
    f = tmp_path / "d.csv"
    f.write_text("prompt,label\nWhat?,1\n")
    with pytest.raises(DatasetError, match=rf"dataset {f}: unsupported file type '.csv'"):
        load_prompts(str(f), tok, cfg)


def test_missing_file(tmp_path, tok, cfg):
    f = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=rf"dataset {f} does not exist"):
        load_prompts(str(f), tok, cfg)


def test_corrupt_parquet(tmp_path, tok, cfg):
    f = tmp_path / "d.parquet"
    f.write_bytes(b"not a parquet file at all")
    with pytest.raises(DatasetError, match=rf"dataset {f}: cannot read parquet"):
        load_prompts(str(f), tok, cfg)


def test_empty_directory(tmp_path, tok, cfg):
    with pytest.raises(DatasetError, match="holds no .parquet or .jsonl files"):
        load_prompts(str(tmp_path), tok, cfg)


# --------------------------------------------------------------------------------------------------------------------
# builtin://arith
# --------------------------------------------------------------------------------------------------------------------
def test_builtin_heldout_size(tok):
    ps = load_prompts("builtin://arith?split=heldout&size=10", tok, DataConfig())
    assert len(ps) == 10
    heldout = {p.text: p for p in problems("heldout")}
    for p in ps.prompts:
        prob = heldout[p.metadata["problem"]]  # KeyError if it is not a held-out problem
        assert p.label == str(prob.answer)
        assert p.prompt_ids


def test_builtin_splits_partition_all_problems():
    train, heldout, everything = problems("train"), problems("heldout"), all_problems()
    assert len(everything) == 100 * 100 + 100 * 10  # additions + multiplications = 11,000
    assert set(train).isdisjoint(heldout)
    assert set(train) | set(heldout) == set(everything)
    assert len(train) + len(heldout) == len(everything)
    assert 0 < len(heldout) < len(train)  # ~10% held out


@pytest.mark.parametrize(
    "uri, problem",
    [
        ("builtin://arith?splt=heldout", "unknown parameter(s) ['splt']"),
        ("builtin://arith?split=test", "builtin://arith has splits ('train', 'heldout'), not 'test'"),
        ("builtin://geometry", "unknown builtin dataset 'builtin://geometry'"),
        ("builtin://arith?size=ten", "invalid literal for int()"),
    ],
)
def test_builtin_bad_uri(tok, uri, problem):
    with pytest.raises(DatasetError) as ei:
        load_prompts(uri, tok, DataConfig())
    assert problem in str(ei.value)


# --------------------------------------------------------------------------------------------------------------------
# the buffer
# --------------------------------------------------------------------------------------------------------------------
def _prompt_set(n: int = 10) -> PromptSet:
    return PromptSet("mem", [Prompt(index=i, prompt_ids=[i, i + 1], prompt=f"p{i}", label=str(i)) for i in range(n)])


def _indices(batch: list[Prompt]) -> list[int]:
    return [p.index for p in batch]


def test_buffer_order_is_deterministic_per_seed():
    a, b, c = DataBuffer(_prompt_set(), seed=1), DataBuffer(_prompt_set(), seed=1), DataBuffer(_prompt_set(), seed=2)
    seq_a = [_indices(a.next_batch(3)) for _ in range(5)]
    seq_b = [_indices(b.next_batch(3)) for _ in range(5)]
    seq_c = [_indices(c.next_batch(3)) for _ in range(5)]
    assert seq_a == seq_b
    assert seq_a != seq_c
    assert seq_a[0] != [0, 1, 2] or seq_a[1] != [3, 4, 5]  # actually shuffled


def test_buffer_covers_each_prompt_once_per_epoch():
    buf = DataBuffer(_prompt_set(10), seed=3)
    epoch0 = _indices(buf.next_batch(3)) + _indices(buf.next_batch(3)) + _indices(buf.next_batch(4))
    assert sorted(epoch0) == list(range(10))
    assert buf.epoch == 0 and buf.offset == 10


def test_buffer_wraps_to_next_epoch():
    buf = DataBuffer(_prompt_set(10), seed=3)
    served = [i for _ in range(3) for i in _indices(buf.next_batch(4))]  # 12 prompts from 10
    assert buf.epoch == 1 and buf.offset == 2
    assert sorted(served[:10]) == list(range(10))
    assert served[:10] == buf._order_for(0)
    assert served[10:] == buf._order_for(1)[:2]
    assert buf._order_for(0) != buf._order_for(1)  # each epoch has its own order


def test_buffer_batch_larger_than_dataset():
    buf = DataBuffer(_prompt_set(4), seed=0)
    served = _indices(buf.next_batch(9))  # 2 full epochs + 1
    assert sorted(served[:4]) == sorted(served[4:8]) == [0, 1, 2, 3]
    assert buf.epoch == 2 and buf.offset == 1


def test_buffer_without_shuffle():
    buf = DataBuffer(_prompt_set(5), seed=0, shuffle=False)
    assert _indices(buf.next_batch(7)) == [0, 1, 2, 3, 4, 0, 1]


def test_buffer_state_round_trip_continues_exactly():
    uninterrupted = DataBuffer(_prompt_set(10), seed=11)
    resumed_from = DataBuffer(_prompt_set(10), seed=11)
    for buf in (uninterrupted, resumed_from):
        buf.next_batch(4)
        buf.next_batch(4)
    state = json.loads(json.dumps(resumed_from.state_dict()))  # as saved with a checkpoint
    assert state == {"epoch": 0, "offset": 8, "seed": 11, "num_prompts": 10}
    fresh = DataBuffer(_prompt_set(10), seed=999)  # the seed comes from the state
    fresh.load_state_dict(state)
    expected = [uninterrupted.next_batch(4) for _ in range(4)]  # crosses into epochs 1 and 2
    got = [fresh.next_batch(4) for _ in range(4)]
    assert [_indices(b) for b in got] == [_indices(b) for b in expected]
    assert got[0][0] == expected[0][0]  # the same prompt, field for field
    assert fresh.epoch == uninterrupted.epoch and fresh.offset == uninterrupted.offset


def test_buffer_state_for_another_dataset_size_raises():
    state = DataBuffer(_prompt_set(10), seed=1).state_dict()
    with pytest.raises(DatasetError, match=r"saved for 10 prompts but mem has 9"):
        DataBuffer(_prompt_set(9), seed=1).load_state_dict(state)
