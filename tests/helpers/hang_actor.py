"""`python -m tests.helpers.hang_actor <vime args>`: the `vime` CLI whose actors are made to stall, so that a test
sees the driver's progress check (rollout.stall_timeout_s / train.stall_timeout_s) on the real engines. The faults
live here, not in the production code:

- VIME_HANG=engine: every engine step sleeps VIME_STEP_DELAY_S (default 0); in generate call VIME_HANG_AT (0-based)
  the engine hangs after 3 steps. The steps of each call are appended to VIME_STEP_LOG, one line per call.
- VIME_HANG=trainer: in rollout VIME_HANG_AT's training the optimizer step hangs (after its micro-batches ran).
- VIME_HANG_MARK: a file that gets the time.time() at which the hang began (to time its report).

The subclasses are defined in `__main__`, so Ray ships them to the actors by value.
"""

from __future__ import annotations

import os
import time

import vime_core.rollout
import vime_core.trainer
from vime_core.cli import app

HANG_S = 3600.0

_Engine = vime_core.rollout.VLLMEngine
_Trainer = vime_core.trainer.Trainer


def hang_now() -> None:
    if os.environ.get("VIME_HANG_MARK"):
        with open(os.environ["VIME_HANG_MARK"], "w") as fh:
            fh.write(f"{time.time()}\n")
    time.sleep(HANG_S)


class HangingEngine(_Engine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def generate(self, *args, **kwargs):
        engine = self.llm.llm_engine
        step, steps = engine.step, [0]
        hang = self.calls == int(os.environ.get("VIME_HANG_AT", "1"))
        delay = float(os.environ.get("VIME_STEP_DELAY_S", "0"))

        def faulty_step(*a, **k):
            steps[0] += 1
            if hang and steps[0] > 3:
                hang_now()
            time.sleep(delay)
            return step(*a, **k)

        engine.step = faulty_step
        try:
            return super().generate(*args, **kwargs)
        finally:
            engine.step = step
            self.calls += 1
            if os.environ.get("VIME_STEP_LOG"):
                with open(os.environ["VIME_STEP_LOG"], "a") as fh:
                    fh.write(f"{steps[0]}\n")


class HangingTrainer(_Trainer):
    def train(self, rollout_id, steps):
        if rollout_id == int(os.environ.get("VIME_HANG_AT", "1")):
            self.state.optim.apply = lambda *a, **k: hang_now()
        return super().train(rollout_id, steps)


if __name__ == "__main__":
    if os.environ.get("VIME_HANG") == "engine":
        vime_core.rollout.VLLMEngine = HangingEngine
    elif os.environ.get("VIME_HANG") == "trainer":
        vime_core.trainer.Trainer = HangingTrainer
    app(prog_name="vime")
