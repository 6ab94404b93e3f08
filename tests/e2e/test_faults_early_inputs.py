"""`vime train` on a small budget and a small dataset: each of prepare's notes is printed once, at start, over two
steps."""

from __future__ import annotations

from tests.integration.test_faults_early_inputs import vime_train
from tests.unit.test_faults_early_inputs import NOTES, SMALL


def test_vime_train_prints_each_note_once(tmp_path):
    """Two steps (each one re-reads the budget and wraps the data): each note is printed once, at start."""
    args = [a for o in SMALL for a in ("--set", o)]
    r = vime_train(
        tmp_path,
        *args,
        *("--set", "train.max_tokens_per_device=32", "--set", "data.source=builtin://arith?size=3"),
        *("--set", "rollout.num_rollout=2", "--set", "eval.datasets=[]"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 2/2" in r.stdout
    assert [r.stderr.count(n) for n in NOTES] == [1, 1], r.stderr[-3000:]
    assert r.stderr.index(NOTES[1]) < r.stderr.index("trainer and engines ready"), "said at start"
