"""Waiting in tests: for a condition to hold (polled, under a deadline, instead of a fixed
sleep), and for a port nobody listens on (instead of a fixed one)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

POLL_S = 0.01


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's pick for a bind to port 0)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
