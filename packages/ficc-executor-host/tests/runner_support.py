"""Driving a real `Runner` in a test: its monitor loop around a block, and waiting on a
real condition with a deadline (never a sleep that a race could outrun)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from ficc.execution.host.runner.pipeline import Runner


async def until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll a real condition with a deadline."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(runner: Runner) -> Any:
    """The runner with its monitor loop, closed afterwards."""
    monitor = asyncio.get_running_loop().create_task(runner.run())
    try:
        yield runner
    finally:
        monitor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await monitor
        await runner.close()
