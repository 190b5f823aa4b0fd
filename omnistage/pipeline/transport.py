"""ZMQ transport between the processes of one pipeline.

Each process binds one PULL socket (``ipc://<dir>/<group>.sock`` on one host; under Ray
placement ``tcp://<node ip>:<free port>``) and owns PUSH sockets to the others. A message
is two frames: a msgpack :class:`Envelope` (msgspec) and a body serialized by
:mod:`omnistage.pipeline.relay` (tensors by shared memory or CUDA IPC to a process on the
same node, inline in the body to one on another node). ZMQ sockets are not thread-safe, so
one sender thread owns the PUSH sockets and one receiver thread owns the PULL socket;
callers on any thread only touch a queue.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Literal, cast

import msgspec
import zmq

from omnistage.core.messages import CoordinatorEvent, StageInput
from omnistage.pipeline import relay
from omnistage.pipeline.control import ControlMessage

logger = logging.getLogger(__name__)

MAIN_GROUP = "main"  # the coordinator's process


Kind = Literal["stage", "abort", "event", "control"]

Body = StageInput | str | tuple[CoordinatorEvent, ...] | ControlMessage
"""Frame 2 of a message, by its envelope's kind: ``stage``: the :data:`StageInput` for
``target``; ``abort``: the id of the request to abort; ``event``: a stage step's
coordinator events, in order; ``control``: one :data:`ControlMessage`."""


class Envelope(msgspec.Struct, array_like=True):
    """Frame 1 of a message. ``kind``: what its :data:`Body` is (the receiver routes
    by it before it looks at the body). ``target``/``source``: stage names (stage
    messages); ``request_id``: the request a stage message or event belongs to ("" for
    control); ``replicas``: the replica of each replicated process group the request runs
    on (stage messages; empty without replicas)."""

    kind: Kind
    target: str = ""
    source: str = ""
    request_id: str = ""
    replicas: dict[str, int] = msgspec.field(default_factory=dict)


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Envelope).decode


def segment_name_prefix(pipeline_prefix: str, sender: str, receiver: str | None = None) -> str:
    """Prefix of the shared-memory segments ``sender`` makes for ``receiver`` (for anyone
    when None): ``<pipeline prefix><sender>.<receiver>.``, so that the segments a dead
    process would have received, or had made, can be swept when it is replaced."""
    return f"{pipeline_prefix}{sender}." + (f"{receiver}." if receiver is not None else "")


class ZmqTransport:
    """Sockets of one process.

    Args:
        group: this process's name (its process group, ``<group>@<replica>`` for a replica).
        addresses: the PULL address of every process known so far (:meth:`set_peers`
            replaces them).
        segment_prefix: shared-memory segment name prefix of this pipeline.
        on_message: ``on_message(envelope, body)``, called on the receiver thread.
        on_undeliverable: ``on_undeliverable(envelope, error)``, called on the receiver
            thread when a message cannot be decoded or delivered (its request fails;
            the receiver goes on).
        bind: the address to bind (``tcp://<ip>:*`` picks a free port; :attr:`address` is
            the one bound); default ``addresses[group]``.
    """

    def __init__(
        self,
        group: str,
        addresses: dict[str, str],
        segment_prefix: str,
        on_message: Callable[[Envelope, Body], None],
        on_undeliverable: Callable[[Envelope, Exception], None],
        *,
        bind: str | None = None,
    ) -> None:
        self.group, self.addresses = group, dict(addresses)
        self.segment_prefix = segment_prefix
        self.on_message, self.on_undeliverable = on_message, on_undeliverable
        self.remote: frozenset[str] = frozenset()  # processes on another node: no shared memory
        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.bind(bind or addresses[group])
        self.address: str = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._outgoing: queue.SimpleQueue[tuple[str, bytes, bytes] | dict[str, str] | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"zmq-send-{group}", daemon=True),
            threading.Thread(target=self._recv_loop, name=f"zmq-recv-{group}", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def send(
        self,
        group: str,
        kind: Kind,
        body: Body,
        target: str = "",
        source: str = "",
        request_id: str = "",
        replicas: dict[str, int] | None = None,
    ) -> None:
        """Thread-safe: serialize ``body`` on the calling thread and queue it for ``group``.
        A message for a process whose address is not known (one that died under Ray
        placement, until it rejoins) is dropped, with a debug log line: its requests have
        failed.

        Raises:
            RelayError: ``body`` cannot be serialized (nothing is queued or left behind).
        """
        header = _encode(Envelope(kind, target, source, request_id, replicas or {}))
        prefix = segment_name_prefix(self.segment_prefix, self.group, group)
        self._outgoing.put((group, header, relay.dumps(body, prefix, shared_memory=group not in self.remote)))

    def set_peers(self, addresses: dict[str, str], remote: frozenset[str]) -> None:
        """Thread-safe: replace the other processes' addresses (a process that rejoined at
        a new address, or one that is gone) and the set of those on another node. Messages
        queued before the call go to the old addresses."""
        self.remote = remote
        self._outgoing.put(dict(addresses))

    def stop(self) -> None:
        self._stopping.set()
        self._outgoing.put(None)
        for thread in self._threads:
            thread.join(timeout=2.0)
        self._context.destroy(linger=0)

    def _send_loop(self) -> None:
        sockets: dict[str, zmq.Socket] = {}
        while (item := self._outgoing.get()) is not None:
            if isinstance(item, dict):
                for group in [g for g in sockets if item.get(g) != self.addresses.get(g)]:
                    sockets.pop(group).close(linger=0)
                self.addresses = {**item, self.group: self.address}
                continue
            group, header, body = item
            if group not in self.addresses:
                logger.debug("dropped a message for %r: its address is not known", group)
                continue
            if group not in sockets:
                sockets[group] = self._context.socket(zmq.PUSH)
                sockets[group].setsockopt(zmq.LINGER, 0)
                sockets[group].connect(self.addresses[group])
            sockets[group].send_multipart([header, body], copy=False)
        for socket in sockets.values():
            socket.close(linger=0)

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(100):
                continue
            header, body = self._pull.recv_multipart()
            envelope = _decode(header)
            try:
                self.on_message(envelope, cast(Body, relay.loads(body)))  # what the sender's send() took
            except Exception as exc:  # noqa: BLE001 -- the process boundary: the message's request fails, the receiver lives
                logger.exception("cannot deliver a %s message for %r", envelope.kind, envelope.request_id)
                self.on_undeliverable(envelope, exc)
        self._pull.close(linger=0)
