"""Run a coroutine to completion from synchronous code, also where an event loop is already running (Ray actors,
Prefect tasks and vLLM may have one on the calling thread): then it runs on a helper thread with its own loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="vime-run-sync")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
