"""A small pool of media decoder worker processes, so no input can crash the server.

Untrusted media (reference audio today; images, audio and video for chat next) is decoded
by :mod:`omnistage.serve.decode_worker` processes, never in the server process: FFmpeg's
codecs are large C code, and a segfault there used to take the whole server down (issue
12: a 9-channel WAV). Each job has a deadline (the parent kills the worker when it passes)
and a memory limit (RLIMIT_AS inside the worker). A worker that dies or is killed fails
only its own job, with a 400 naming the field, and is replaced at the next job; its death
is logged with the request id (:data:`request_id_var`, set by the server per request). A
worker whose job ran out of its memory limit answers the refusal and is retired too (a
failed allocation may leave FFmpeg or PyAV broken: its next job was seen to segfault).

Workers are plain ``python -m`` subprocesses (not multiprocessing children: those re-import
the server's ``__main__`` and with it torch), at most :attr:`DecoderPool.size` of them,
started by :meth:`DecoderPool.start` (the server does it as it starts) or else at their first
job, and they exit when their stdin closes (the server is gone). :func:`shared_pool` is the
process-wide pool. A job and its reply pass through pipes of :data:`PIPE_BYTES`.
"""

from __future__ import annotations

import atexit
import contextvars
import fcntl
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Final

import msgspec

from omnistage.serve.decode_jobs import (
    FRAME_HEADER,
    DecodeJob,
    DecodeRefused,
    DecodeReply,
    decode_frame,
    encode_frame,
)

__all__ = ["DecoderCrashed", "DecoderPool", "DecoderTimeout", "request_id_var", "shared_pool"]

logger = logging.getLogger(__name__)

#: The request a decode job belongs to, for the log line of a crash or timeout.
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "omnistage_decode_request_id", default=None
)

#: Workers of a pool by default: half the machine's cores, at least 2 and at most 8; each
#: live one holds ~45 MiB (python + PyAV + numpy). Two decoded in parallel on a 2-core
#: machine; on the 16-core H200 host they queued a concurrency-64 run of image chats for
#: 838 ms each (mean ``admitted`` phase, 640x480 PNGs, ``benchmarks/qwen3_omni_served.py``,
#: 2026-12-02).
DEFAULT_WORKERS: Final = min(8, max(2, (os.cpu_count() or 2) // 2))
_READ_CHUNK: Final = 1 << 20
#: Bytes each pipe to and from a worker holds (``F_SETPIPE_SZ``; Linux's default is 64 KiB,
#: and 1 MiB is its default ``/proc/sys/fs/pipe-max-size`` for unprivileged processes), so a
#: 640x480 image job (0.9 MB) and its RGB reply (0.9 MB) each pass in one write and one read
#: instead of ~15 of 64 KiB. Each of those syscalls releases the GIL and takes it back, and
#: with the engine threads busy taking it back waits for their switch interval (5 ms).
PIPE_BYTES: Final = 1 << 20


class DecoderCrashed(Exception):
    """The worker died while decoding the job (``reason``: its exit code or signal)."""


class DecoderTimeout(Exception):
    """The job ran past its deadline; the worker was killed."""


class _Worker:
    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "omnistage.serve.decode_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C goes to the server, which stops it
        )
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            except OSError:
                pass  # above the user's pipe quota (EPERM): the default size still works, slower

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, job: DecodeJob, timeout_s: float) -> DecodeReply:
        """Send ``job`` and wait for its reply at most ``timeout_s`` seconds.

        Raises:
            DecoderCrashed: the worker died (or sent garbage) before replying.
            DecoderTimeout: no reply in time (the worker is killed).
        """
        deadline = time.monotonic() + timeout_s
        try:
            self.process.stdin.write(encode_frame(job))
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise DecoderCrashed(self._exit_reason()) from None
        header = self._read(FRAME_HEADER.size, deadline)
        body = self._read(FRAME_HEADER.unpack(header)[0], deadline)
        try:
            return decode_frame(body, DecodeReply)
        except msgspec.DecodeError:
            self.kill()
            raise DecoderCrashed("it sent a malformed reply") from None

    def _read(self, size: int, deadline: float) -> bytes:
        fd, data = self.process.stdout.fileno(), bytearray()
        while len(data) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self.kill()
                raise DecoderTimeout
            chunk = os.read(fd, min(size - len(data), _READ_CHUNK))
            if not chunk:
                raise DecoderCrashed(self._exit_reason())
            data += chunk
        return bytes(data)

    def _exit_reason(self) -> str:
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.kill()
            return "it stopped answering"
        if code < 0:
            return f"it was killed by {signal.Signals(-code).name}"
        return f"it exited with code {code}"

    def kill(self) -> None:
        if self.alive:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass  # a pipe to a dead worker may fail to flush: nothing left to deliver


class DecoderPool:
    """At most ``size`` decoder workers, one job each at a time; thread-safe.

    Args:
        size: number of worker processes (>= 1).
    """

    def __init__(self, size: int = DEFAULT_WORKERS) -> None:
        if size < 1:
            raise ValueError(f"a decoder pool needs at least one worker, got {size}")
        self.size = size
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()
        for _ in range(size):
            self._idle.put(None)  # a free slot without a process yet
        self._workers: set[_Worker] = set()
        self._lock = threading.Lock()
        self.jobs_in_flight = 0

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and operators)."""
        with self._lock:
            return sorted(w.pid for w in self._workers if w.alive)

    def grow(self, size: int) -> None:
        """Allow at least ``size`` workers (a larger pool keeps its size); the new ones
        start at their first job.

        Raises:
            ValueError: ``size < 1``.
        """
        if size < 1:
            raise ValueError(f"a decoder pool needs at least one worker, got {size}")
        with self._lock:
            added, self.size = max(0, size - self.size), max(self.size, size)
        for _ in range(added):
            self._idle.put(None)

    def start(self) -> None:
        """Start every worker now instead of at its first job (server start)."""
        slots = [self._idle.get() for _ in range(self.size)]
        for slot in slots:
            self._idle.put(slot if slot is not None and slot.alive else self._spawn())

    def run(self, job: DecodeJob, timeout_s: float) -> DecodeReply:
        """Decode ``job`` in a worker, waiting at most ``timeout_s`` for its reply.

        Raises:
            DecoderCrashed: the worker died on this job (it is replaced).
            DecoderTimeout: the job ran past ``timeout_s`` (the worker is killed, replaced).
        """
        worker = self._idle.get()
        with self._lock:
            self.jobs_in_flight += 1
        try:
            if worker is None or not worker.alive:  # never started, or died while idle
                self._forget(worker)
                worker = self._spawn()
            reply = worker.run(job, timeout_s)
            if isinstance(reply, DecodeRefused) and reply.out_of_memory:
                self._forget(worker)  # a failed allocation may have left its decoders broken
                worker = None
        except (DecoderCrashed, DecoderTimeout) as exc:
            self._log_failure(worker, exc, timeout_s)
            self._forget(worker)
            worker = None
            raise
        finally:
            with self._lock:
                self.jobs_in_flight -= 1
            self._idle.put(worker)
        return reply

    def close(self) -> None:
        """Stop every worker (idempotent); later jobs start new ones."""
        with self._lock:
            workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.kill()

    def _spawn(self) -> _Worker:
        worker = _Worker()
        with self._lock:
            self._workers.add(worker)
        return worker

    def _forget(self, worker: _Worker | None) -> None:
        if worker is None:
            return
        worker.kill()
        with self._lock:
            self._workers.discard(worker)

    @staticmethod
    def _log_failure(worker: _Worker | None, exc: Exception, timeout_s: float) -> None:
        what = (
            f"ran past its {timeout_s:g} s deadline"
            if isinstance(exc, DecoderTimeout)
            else str(exc)
        )
        pid = worker.pid if worker is not None else "?"
        logger.error(
            "request %s: media decoder worker (pid %s) failed on its input: %s; replacing it",
            request_id_var.get() or "-", pid, what,
        )  # fmt: skip


_shared: DecoderPool | None = None
_shared_lock = threading.Lock()


def shared_pool(size: int = DEFAULT_WORKERS) -> DecoderPool:
    """The process-wide pool, of at least ``size`` workers (started lazily; it grows to the
    largest size asked, see :meth:`DecoderPool.grow`).

    Raises:
        ValueError: ``size < 1``.
    """
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = DecoderPool(size)
            atexit.register(_shared.close)
        else:
            _shared.grow(size)
        return _shared
