"""How a flow runs from the command line (`vime-pipeline`, `python -m flows.evaluate`): one door, so that both meet
bad input, Ctrl-C and a SIGKILL the same way."""

from __future__ import annotations

import signal
import sys
from typing import Callable, TypeVar

from flows.local_api import start_local_api
from vime_core.errors import debug_requested, one_line, user_error
from vime_core.stop import stop_on_signal, stop_signal

Config = TypeVar("Config")


def run_flow_locally(load: Callable[[], Config], call: Callable[[Config], object], debug: bool = False) -> int:
    """`call(load())` with the process's temporary Prefect server; the process's exit code (0 once `call` returns;
    `call` prints what the user should see).
    `load` (the config, the arguments) runs before anything starts, so bad input costs no server start.
    A user error (VimeError, raised here or by an actor) prints one line and gives its exit code (2); `debug` or
    VIME_DEBUG=1 shows its traceback instead. Ctrl-C stops the flow through its cleanup (its own except/finally
    say what was saved) and gives 130; SIGTERM stays Prefect's (a TerminationSignal in the flow, then the process
    ends by SIGTERM)."""
    from vime_core.orphans import start_watchdog

    start_watchdog()  # a SIGKILLed command takes its temporary Prefect server, Ray and the actors with it
    try:
        cfg = load()
        start_local_api()
        with stop_on_signal((signal.SIGINT,)):
            try:
                call(cfg)
                return 0
            except BaseException as e:
                if (signum := stop_signal(e)) is not None:
                    return 128 + signum
                raise
    except Exception as e:
        user = user_error(e)
        if debug or debug_requested([]) or user is None:
            raise
        print(f"{one_line(user)}  (--debug shows the traceback)", file=sys.stderr)
        return user.exit_code
