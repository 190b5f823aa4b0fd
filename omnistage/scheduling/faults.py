"""Fault injection at the batch boundary, for tests and soak runs (off unless asked).

``OMNISTAGE_FAULTS`` (read when a scheduler is bound to its stage; stage processes inherit
it) lists faults, comma-separated, each ``STAGE:KIND[=ARG](@N|~P)``:

- ``KIND``: ``raise`` (``RuntimeError``), ``oom`` (``torch.OutOfMemoryError``: a CUDA
  out-of-memory, simulated on CPU), ``hang=SECONDS`` (the batch sleeps that long before
  computing: past the request deadline, the coordinator ends it), ``kill`` (SIGKILL of
  the stage's own process; only in a stage process, never the server's);
- ``@N``: at the N-th batch of that stage (1-based, once); ``~P``: at each batch with
  probability P, from a generator seeded by ``OMNISTAGE_FAULTS_SEED`` (default 0) and the
  stage name, so a run is repeatable.

Example: ``OMNISTAGE_FAULTS="synthesis:raise~0.01,tts_engine:hang=3@40,vocoder:kill@200"``.
An injected fault goes through the same path as a real one (:meth:`Scheduler.run_batch`):
raise and oom fail the batch's requests (500, or a stream without its done event).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import re
import signal
import time
import zlib
from dataclasses import dataclass
from typing import Final, Literal

import torch

__all__ = ["FAULTS_ENV", "Fault", "FaultInjector", "parse_faults"]

logger = logging.getLogger(__name__)

FAULTS_ENV: Final = "OMNISTAGE_FAULTS"
SEED_ENV: Final = "OMNISTAGE_FAULTS_SEED"
_SPEC: Final = re.compile(
    r"(?P<stage>[\w.-]+):(?P<kind>raise|oom|hang|kill)(=(?P<arg>[\d.]+))?"
    r"((@(?P<nth>\d+))|(~(?P<p>[\d.]+)))"
)

FaultKind = Literal["raise", "oom", "hang", "kill"]


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` at batch ``nth`` (1-based) or with ``probability`` per batch;
    ``hang_s``: the sleep of a ``hang``."""

    stage: str
    kind: FaultKind
    nth: int | None = None
    probability: float = 0.0
    hang_s: float = 0.0


def parse_faults(spec: str) -> list[Fault]:
    """Parse an ``OMNISTAGE_FAULTS`` value (grammar in the module docstring).

    Raises:
        ValueError: an item does not follow the grammar, or a hang has no duration.
    """
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        match = _SPEC.fullmatch(item)
        if match is None:
            raise ValueError(f"{FAULTS_ENV}: {item!r} is not STAGE:KIND[=ARG](@N|~P)")
        kind = match["kind"]
        if (kind == "hang") != (match["arg"] is not None):
            raise ValueError(f"{FAULTS_ENV}: {item!r}: hang takes =SECONDS, the others no argument")
        faults.append(
            Fault(
                stage=match["stage"],
                kind=kind,
                nth=int(match["nth"]) if match["nth"] else None,
                probability=float(match["p"] or 0.0),
                hang_s=float(match["arg"] or 0.0),
            )
        )
    return faults


class FaultInjector:
    """The faults of one stage; :meth:`before_batch` fires them. Thread-compatible (one
    scheduler thread calls it)."""

    def __init__(self, stage: str, faults: list[Fault]) -> None:
        self.stage = stage
        self.faults = [f for f in faults if f.stage == stage]
        self.batches = 0
        self._in_stage_process = multiprocessing.parent_process() is not None
        if any(f.kind == "kill" for f in self.faults) and not self._in_stage_process:
            raise ValueError(
                f"{FAULTS_ENV}: kill at stage {stage!r}, which runs in the server process"
            )
        seed = int(os.environ.get(SEED_ENV, "0"))
        self._random = random.Random(seed * 1_000_003 + zlib.crc32(stage.encode()))

    @classmethod
    def from_env(cls, stage: str) -> FaultInjector | None:
        """The injector ``OMNISTAGE_FAULTS`` asks for at ``stage``; None when it names none.

        Raises:
            ValueError: the variable is malformed, or asks to kill a server-process stage.
        """
        spec = os.environ.get(FAULTS_ENV, "")
        injector = cls(stage, parse_faults(spec)) if spec else None
        return injector if injector is not None and injector.faults else None

    def before_batch(self) -> None:
        """Count the batch and fire the faults due at it.

        Raises:
            RuntimeError: a ``raise`` fault.
            torch.OutOfMemoryError: an ``oom`` fault.
        """
        self.batches += 1
        for fault in self.faults:
            due = (
                self.batches == fault.nth
                if fault.nth is not None
                else self._random.random() < fault.probability
            )
            if due:
                self._fire(fault)

    def _fire(self, fault: Fault) -> None:
        logger.warning(
            "stage %s: injected fault %s at batch %d", self.stage, fault.kind, self.batches
        )
        if fault.kind == "raise":
            raise RuntimeError(f"injected fault at stage {self.stage!r}, batch {self.batches}")
        if fault.kind == "oom":
            raise torch.OutOfMemoryError(f"injected: CUDA out of memory at stage {self.stage!r}")
        if fault.kind == "hang":
            time.sleep(fault.hang_s)
        else:  # kill: only ever in a stage process (checked at construction)
            os.kill(os.getpid(), signal.SIGKILL)
