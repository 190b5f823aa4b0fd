"""Request ids, finish reasons, and the base of every pipeline request."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a request ended: ``"stop"`` (EOS), ``"length"`` (cap reached), ``"abort"``, ``"error"``."""

FINISH_SEVERITY: dict[FinishReason, int] = {"stop": 0, "length": 1, "abort": 2, "error": 3}
"""Order used to merge several terminals' finish reasons: the most severe one wins."""

_counter = itertools.count()


def new_request_id() -> str:
    """A fresh request id, unique across processes and restarts (``req-<12 hex>-<n>``)."""
    return f"req-{uuid.uuid4().hex[:12]}-{next(_counter)}"


def most_severe(reasons: Iterable[FinishReason]) -> FinishReason:
    """The most severe of ``reasons`` (``"stop"`` when there are none)."""
    return max(reasons, key=FINISH_SEVERITY.__getitem__, default="stop")


class PipelineRequest:
    """Base of every model's typed pipeline request (what ``build_request`` returns and
    every stage reads as ``StagePayload.request``): a model subclasses it with its own
    (frozen) dataclass. It has no fields; the coordinator refuses anything else at
    submission (``TypeError``), so no stage ever sees an untyped request."""

    __slots__ = ()
