"""Control messages between the server process and its stage processes: one class per
purpose, the body of a transport ``control`` envelope (:mod:`omnistage.pipeline.transport`).

From a stage process to the server: :class:`Ready`, :class:`StartupFailed`,
:class:`StateReply`; under Ray placement also :class:`Hello` and :class:`Beat`. From the
server to a stage process: :class:`StateQuery`, :class:`Stop`; under Ray placement also
:class:`Peers`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Ready:
    """``endpoint`` built its stages and serves."""

    endpoint: str


@dataclass(frozen=True, slots=True)
class StartupFailed:
    """``endpoint`` could not build its stages; ``trace``: the formatted traceback."""

    endpoint: str
    trace: str


@dataclass(frozen=True, slots=True)
class StateQuery:
    """Asks a stage process for its per-request state; its :class:`StateReply` repeats
    ``token``."""

    token: str


@dataclass(frozen=True, slots=True)
class StateReply:
    """``endpoint``'s answer to the :class:`StateQuery` of ``token``: its stages'
    per-request state (:meth:`omnistage.pipeline.host.StageHost.live_state`)."""

    token: str
    endpoint: str
    state: dict[str, dict[str, list[str]]]


@dataclass(frozen=True, slots=True)
class Stop:
    """The stage process stops its stages and exits."""


@dataclass(frozen=True, slots=True)
class Hello:
    """A Ray actor incarnation's first message: where it listens and on which Ray node."""

    endpoint: str
    incarnation: str
    address: str
    node_id: str
    pid: int


@dataclass(frozen=True, slots=True)
class Beat:
    """A Ray actor incarnation's heartbeat (every quarter of ``process_death_timeout_s``)."""

    endpoint: str
    incarnation: str


@dataclass(frozen=True, slots=True)
class Peers:
    """The address of every live process (``addresses``, by endpoint) and the endpoints
    on another Ray node than the receiver (``remote``: no shared memory to them)."""

    addresses: dict[str, str]
    remote: frozenset[str]


ControlMessage = Ready | StartupFailed | StateQuery | StateReply | Stop | Hello | Beat | Peers
