"""How long each pipeline stage took the last time, and so when the one starting now should end: the ETA line of
stages that have no steps to count (download, conversion, engine start with training, export, evaluation,
registration). Kept in a small JSON file in the config's output_dir (`stage-seconds.json`), which nightly runs
share: theirs are `<output_dir>/nightly/<night>`. Written when a stage completes; a failed stage keeps the last good
figure."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from vime_core.fsutil import atomic_write_text
from vime_core.logs import fmt_seconds

FILE = "stage-seconds.json"


def times_file(output_dir: Path) -> Path:
    """A night's dir is new every night: the estimate lives in the config's own output_dir, two levels up (not in
    `nightly/`, whose entries are the nights)."""
    output_dir = Path(output_dir)
    return (output_dir.parent.parent if output_dir.parent.name == "nightly" else output_dir) / FILE


class StageTimes:
    def __init__(self, path: Path, log: Callable[[str], None] = print):
        self.path, self.log = Path(path), log
        try:
            self.seconds: dict[str, float] = json.loads(self.path.read_text())
        except (OSError, ValueError):  # none yet, or unreadable: no estimate, never an error
            self.seconds = {}

    def start_line(self, name: str, now: float) -> str:
        last = self.seconds.get(name)
        if last is None:
            return f"stage {name}: started (no earlier run to estimate from)"
        end = time.strftime("%H:%M:%S", time.localtime(now + last))
        return f"stage {name}: started | took {fmt_seconds(last)} last time | eta {end}"

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.time()
        self.log(self.start_line(name, t0))
        yield
        took = time.time() - t0
        self.seconds[name] = round(took, 1)
        self.log(f"stage {name}: done in {fmt_seconds(took)}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(self.seconds, indent=1, sort_keys=True), durable=False)
        except OSError:  # an estimate is not worth failing a night for
            pass
