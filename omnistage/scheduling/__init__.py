"""Schedulers: the compute loop of a stage, on its own thread."""

from omnistage.scheduling.base import ItemFailure, ItemResult, Scheduler, StageOutbox
from omnistage.scheduling.simple import SimpleScheduler
from omnistage.scheduling.streaming import StreamingScheduler, StreamState
from omnistage.scheduling.threaded import ThreadedScheduler

__all__ = [
    "ItemFailure",
    "ItemResult",
    "Scheduler",
    "SimpleScheduler",
    "StageOutbox",
    "StreamState",
    "StreamingScheduler",
    "ThreadedScheduler",
]
