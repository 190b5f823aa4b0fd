"""Drive an :class:`~omnistage.engine.engine.AREngine` through a schedule of arrivals (tests).

``arrivals[step]`` lists the ``(request_id, GenerationInput)`` pairs added before that
step; the engine is stepped until it is idle and no arrival is left.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.engine.engine import AREngine
from omnistage.engine.sequence import GenerationInput, GenerationResult


@dataclass
class EngineRun:
    """What the steps gave, per request id: its result, its streamed frames (``[1, G]``
    int64 each, in step order) and its hidden rows (``return_hidden`` requests only)."""

    results: dict[str, GenerationResult] = field(default_factory=dict)
    frames: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    hidden: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def run_arrivals(
    engine: AREngine, arrivals: dict[int, list[tuple[str, GenerationInput]]]
) -> EngineRun:
    """Step ``engine`` until idle, adding ``arrivals[step]`` before each step."""
    run, step = EngineRun(), 0
    while engine.has_work() or any(s >= step for s in arrivals):
        for request_id, inputs in arrivals.get(step, []):
            engine.add_request(request_id, inputs)
        for out in engine.step():
            if out.hidden is not None:
                run.hidden.setdefault(out.request_id, []).append(out.hidden)
            if out.frame is not None:
                run.frames.setdefault(out.request_id, []).append(out.frame)
            if out.result is not None:
                run.results[out.request_id] = out.result
        step += 1
    return run
