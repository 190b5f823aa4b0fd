"""The leak check: after requests end, no stage, relay or coordinator holds their state."""

from __future__ import annotations

import asyncio
import time

from omnistage.pipeline.pipeline import LiveState, Pipeline


async def assert_no_request_state(pipeline: Pipeline, settle_s: float = 5.0) -> None:
    """Wait up to ``settle_s`` for in-flight aborts to land, then assert that
    :meth:`Pipeline.live_state` is empty (in every process).

    Raises:
        AssertionError: listing every structure that still holds a request.
    """
    deadline = time.monotonic() + settle_s
    state: dict[str, LiveState] = {}
    while time.monotonic() < deadline:
        state = await pipeline.live_state()
        if not state:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"per-request state left behind: {state}")
