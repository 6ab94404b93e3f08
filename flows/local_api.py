"""The temporary Prefect server of a command-line run (`vime-pipeline`, `python -m flows.evaluate`): with no
PREFECT_API_URL, Prefect starts one for the process (its ephemeral mode) the first time a client is made."""

from __future__ import annotations

import signal


def start_local_api() -> None:
    """Start that server now with SIGINT blocked in it (a child inherits the signal mask, and keeps it across exec).
    A terminal's Ctrl-C reaches the whole process group: a server dead of it left the interrupted pipeline unable to
    record its end (measured on `make run`: 142 s of connection retries, a traceback, exit 1). It still stops at exit
    (Prefect's atexit sends SIGTERM). With PREFECT_API_URL set there is nothing to start."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with get_client(sync_client=True) as client:
            client.api_healthcheck()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
