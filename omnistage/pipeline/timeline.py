"""A request's timeline: named points in time from HTTP receipt to the first byte written,
so every time to first audio (TTFA) can be decomposed into phases.

Marks (``time.monotonic()`` seconds; one clock for every process of the host):

- ``received``: the server read the request (the origin, 0);
- ``admitted``: parsed, validated, media decoded, handed to the pipeline;
- ``<stage>.first_output`` and ``<stage>.result``: a stage sent a request's first stream
  item, and its result (every stage, by the stage runtime);
- scheduler marks, e.g. ``<engine stage>.prefill``: the request's prefill was launched;
- ``first_byte``: the first audio byte was handed to the HTTP response.

A phase is named by the mark that ends it and lasts from the mark before it (marks in time
order), so the phases up to ``first_byte`` are ordered and sum to the server's TTFA
exactly. For Qwen3-TTS: ``admitted`` (request parsing and reference-audio decoding),
``reference_encoder.result`` (Base: batching and encoding the reference clip),
``preprocessing.first_output`` (prompt building),
``tts_engine.prefill`` (waiting for admission into the engine), ``tts_engine.first_output``
(prefill and the first frame), ``vocoder.first_output`` (the first vocoder chunk) and
``first_byte`` (encoding and handing it to the response).
"""

from __future__ import annotations

from dataclasses import dataclass, field

RECEIVED = "received"
ADMITTED = "admitted"
FIRST_OUTPUT = "first_output"
RESULT = "result"
FIRST_BYTE = "first_byte"


@dataclass
class Timeline:
    """The marks of one request, in the order they were recorded.

    Attributes:
        marks: ``(name, monotonic seconds)``; the first is ``received``.
    """

    marks: list[tuple[str, float]] = field(default_factory=list)

    def add(self, name: str, at: float) -> None:
        self.marks.append((name, at))

    def at(self, name: str) -> float | None:
        """The time of the first mark called ``name``, or None."""
        return next((t for n, t in self.marks if n == name), None)

    def phases(self, until: str = FIRST_BYTE) -> list[tuple[str, float]]:
        """``(name, seconds)`` per phase from the first mark to ``until`` (included; all
        marks when it was not reached), in time order; the phases sum to the time from the
        first mark to the last one included."""
        ordered = sorted(self.marks, key=lambda mark: mark[1])
        end = self.at(until)
        if end is not None:
            ordered = [m for m in ordered if m[1] <= end]
        return [
            (name, at - before)
            for (_, before), (name, at) in zip(ordered, ordered[1:], strict=False)
        ]

    def offsets_ms(self) -> list[tuple[str, float]]:
        """``(name, ms after the first mark)`` per mark, in time order."""
        if not self.marks:
            return []
        origin = self.marks[0][1]
        return [
            (name, (at - origin) * 1e3) for name, at in sorted(self.marks, key=lambda mark: mark[1])
        ]

    def header(self) -> str:
        """The marks as an HTTP header value: ``name=ms;name=ms`` (ms after ``received``,
        2 decimals), see :func:`parse_header`."""
        return ";".join(f"{name}={ms:.2f}" for name, ms in self.offsets_ms())


def parse_header(value: str) -> list[tuple[str, float]]:
    """Inverse of :meth:`Timeline.header`: ``(name, ms after received)`` per mark.

    Raises:
        ValueError: a malformed value.
    """
    marks = []
    for item in filter(None, value.split(";")):
        name, sep, ms = item.partition("=")
        if not sep or not name:
            raise ValueError(f"malformed timeline mark {item!r}")
        marks.append((name, float(ms)))
    return marks
