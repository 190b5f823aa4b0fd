"""Waiting in tests: for a condition to hold (polled, under a deadline, instead of a fixed
sleep), for a port nobody listens on (instead of a fixed one), and what a wait that ran out
reports: every thread's stack (:func:`thread_stacks`)."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

POLL_S = 0.01


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's pick for a bind to port 0)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` TCP ports free on ``host`` now, all different: bound together, so the
    kernel cannot hand out one twice (separate :func:`free_port` calls can: each releases
    its port before the next pick)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition") -> None:
    """Return as soon as ``predicate()`` is true, polling every :data:`POLL_S` seconds.

    Raises:
        AssertionError: it was still false after ``timeout_s`` seconds (naming ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s:g} s")
        time.sleep(POLL_S)


async def wait_until_async(predicate: Callable[[], object], timeout_s: float = 10.0, what: str = "the condition") -> None:
    """:func:`wait_until` on an event loop (the loop runs while it waits).

    Raises:
        AssertionError: ``predicate()`` was still false after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s:g} s")
        await asyncio.sleep(POLL_S)


def thread_stacks() -> str:
    """Every thread's stack of this process, as text for a failure message; also written at
    once to the process's real stderr (past pytest's capture), so a run killed afterwards
    (a hung device blocking the teardown) still shows them."""
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return "\n".join(
        f"--- thread {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}"
        for ident, frame in sys._current_frames().items()
    )
