"""vime_core.stage_times: the ETA line of pipeline stages from how long they took the last time."""

from __future__ import annotations

import json

import pytest

from vime_core.stage_times import StageTimes, times_file


def test_a_stage_without_history_says_so_and_is_recorded(tmp_path):
    lines: list[str] = []
    clock = StageTimes(tmp_path / "stage-seconds.json", lines.append)
    with clock.stage("convert"):
        pass
    assert lines[0] == "stage convert: started (no earlier run to estimate from)"
    assert lines[1].startswith("stage convert: done in 0:00")
    assert set(json.loads((tmp_path / "stage-seconds.json").read_text())) == {"convert"}


def test_the_next_run_gives_the_last_duration_and_an_end_time(tmp_path):
    (tmp_path / "stage-seconds.json").write_text(json.dumps({"evaluate": 125.0}))
    line = StageTimes(tmp_path / "stage-seconds.json").start_line("evaluate", now=0.0)
    assert line.startswith("stage evaluate: started | took 2:05 last time | eta ")


def test_a_failed_stage_keeps_the_last_good_figure(tmp_path):
    path = tmp_path / "stage-seconds.json"
    path.write_text(json.dumps({"train": 300.0}))
    with pytest.raises(RuntimeError):
        with StageTimes(path, lambda _: None).stage("train"):
            raise RuntimeError("boom")
    assert json.loads(path.read_text()) == {"train": 300.0}


def test_an_unreadable_file_gives_no_estimate_and_no_error(tmp_path):
    (tmp_path / "stage-seconds.json").write_text("{not json")
    assert "no earlier run" in StageTimes(tmp_path / "stage-seconds.json").start_line("export", now=0.0)


def test_nights_share_the_configs_output_dir_and_other_runs_keep_their_own(tmp_path):
    night = tmp_path / "runs" / "tiny-cpu" / "nightly" / "2026-12-03-abc"
    assert times_file(night) == tmp_path / "runs" / "tiny-cpu" / "stage-seconds.json"
    assert times_file(tmp_path / "runs" / "tiny-cpu") == tmp_path / "runs" / "tiny-cpu" / "stage-seconds.json"
