"""ARScheduler: an AR engine (:class:`~omnistage.engine.engine.AREngine`) as a pipeline stage.

Payload contract: the stage's input is a
:class:`~omnistage.engine.sequence.GenerationInput` (prompt embeddings ``[L, H]`` or token
ids ``[L]``, per-step rows ``[M, H]`` and a pad row ``[H]``, sampling params with stop ids
and ``min_new_tokens``, ``max_new_tokens``, code-predictor sampling), by default the
payload's ``data``; a model passes ``build_input`` to derive it otherwise. A request the
engine cannot take fails at once with a typed error (``QueueFullError`` when the waiting
queue is full, ``RequestValidationError`` when it can never fit).

Output, with ``stream_frames`` (the default): every frame goes to the stage's stream
targets as soon as the host has it, as a :class:`CodeFrames` item (``[1, G] int64`` host
tensor; small enough to travel by value), a step's frames of every request in one message
per target (``StageOutbox.stream_many``): on CUDA one step after it was computed (the host
reads step t's frames while the device runs step t+1). A request with ``return_hidden``
gets :class:`FrameWithHidden` items instead: each frame with the hidden-layer rows of the
tokens its step fed, plus, when a stop id ends it, a last item with no frame and the rows
of its last token. The result is then a :class:`GenerationSummary` (counts only: frames
travel once). Without ``stream_frames`` nothing is streamed and the result is the whole
:class:`~omnistage.engine.sequence.GenerationResult` (``[T, G]``). Either way the
request's finish_reason is ``"stop"`` (a stop id; the stop frame is not emitted) or
``"length"`` (``max_new_tokens``), passed in the framework's result, so it reaches the
client through the stages after this one.

Aborts free the request's KV blocks at once; a step that raises fails exactly the
requests of that step (the batch boundary, :meth:`Scheduler.run_batch`), whose blocks the
engine has already freed.

Stream input (a stage with stream sources, e.g. the Omni talker fed by the thinker, or
text streamed into a running Qwen3-TTS generation): each request gets a
:class:`StreamInput` that turns its payload, stream chunks and stream-done into engine
calls (:class:`RowFeed`): start the request (usually with ``more_rows``), append step rows
to it while it runs, mark its rows complete. A stage that takes client input (its
client's text, e.g.) gets it the same way: chunks to ``on_chunk``, the end of the input to
``on_input_done``. The default, :class:`RowStream`, starts it
from the payload (``build_input``), appends each chunk's ``[K, H]`` tensor and completes
on stream-done; a model subclasses :class:`StreamInput` for its own hand-off (e.g. a
start once the first chunks arrived, before the payload). A request whose result is
ready before its payload arrived keeps the result until it does (the stage runtime
routes a result with its payload). Chunks and stream-done of a request that ended are
dropped.

Stop strings (``GenerationInput.stop_strings``, a stage built with ``token_text``): the
stage watches each such request's tokens (:class:`~.stop_strings.StopStringMatcher`) and
streams a frame only once its text can no longer be the start of a stop string (a frame's
:class:`FrameWithHidden` item waits with it). When a stop string appears, the engine request
ends at once (:meth:`~omnistage.engine.engine.AREngine.stop`: its KV freed), the frames before
it are streamed, then for a ``return_hidden`` request the last item with no frame and the
rows of its last kept token (as a stop id ends one), then a :class:`StopTail` when the stop
string began inside a token; the result's finish_reason is ``"stop"`` and its frames are the
kept ones and the tail's tokens. A request that ends otherwise releases its held frames
first. So every stream target gets the same tokens, none past the stop.

Timeline: the stage marks ``prefill`` when a request's prefill is launched (its wait for
admission ends there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from omnistage.core.errors import OmnistageError
from omnistage.core.messages import (
    CLIENT_SOURCE,
    Abort,
    StageInput,
    StagePayload,
    StreamChunk,
    StreamDone,
)
from omnistage.core.tombstones import Tombstones
from omnistage.engine.engine import AREngine, StepOutput, StepPlan
from omnistage.engine.sequence import GenerationInput, GenerationResult
from omnistage.scheduling.base import BatchKind, Scheduler
from omnistage.scheduling.stop_strings import StopMatch, StopStringMatcher, TokenText

PREFILL_MARK = "prefill"  # timeline: the request's prefill is launched


@dataclass(frozen=True, slots=True)
class CodeFrames:
    """Frames streamed by an AR stage.

    Attributes:
        codes: ``[n, G] int64`` codes of ``n >= 1`` consecutive frames (the engine's
            frames are host tensors).
    """

    codes: torch.Tensor

    def __reduce__(self) -> tuple:
        # To another process a host tensor travels as the numpy array of its own rows: a
        # frame is a view of its step's [B, G] tensor, and torch pickles a view's whole
        # storage (through torch.save) each time. At 128 streams that made one step's
        # frames 2.1 MB and 24 ms to pickle (35 ms with the unpickle) on the engine's
        # thread; as arrays: 128 x 128 bytes (benchmarks/README.md, "split placement").
        if self.codes.is_cuda:
            return CodeFrames, (self.codes,)
        return _code_frames_from_numpy, (self.codes.numpy().copy(),)


def _code_frames_from_numpy(codes: np.ndarray) -> CodeFrames:
    return CodeFrames(torch.from_numpy(codes))


@dataclass(frozen=True)
class StopTail:
    """The end of a reply whose stop string began inside a token (module docstring, stop
    strings): the text before the stop string within that token, re-tokenized.

    Attributes:
        token_ids: ``[n] int64``, n >= 1: they follow the reply's streamed tokens (the model
            generated a token holding more than them, which is not streamed).
    """

    token_ids: torch.Tensor


@dataclass(frozen=True)
class GenerationSummary:
    """An AR stage's result when it streamed its frames.

    Attributes:
        num_frames: frames streamed (the stop frame excluded), and a :class:`StopTail`'s
            tokens.
        num_prompt_tokens: the prompt's length ``L``.
    """

    num_frames: int
    num_prompt_tokens: int


def _frame_item(out: StepOutput) -> CodeFrames | FrameWithHidden:
    """The stream item of a step's output that has a frame or hidden rows."""
    if out.hidden is None:
        assert out.frame is not None
        return CodeFrames(out.frame)
    return FrameWithHidden(out.frame, out.hidden)


def payload_data(payload: StagePayload) -> GenerationInput:
    """The default ``build_input``: the payload's data, which must be a GenerationInput.

    Raises:
        TypeError: it is not.
    """
    if not isinstance(payload.data, GenerationInput):
        raise TypeError(f"an AR stage takes a GenerationInput, got {type(payload.data).__name__}")
    return payload.data


@dataclass(frozen=True)
class FrameWithHidden:
    """A stream chunk of a request with ``return_hidden`` (see
    :class:`~omnistage.engine.engine.StepOutput`).

    Attributes:
        frame: ``[1, G] int64``, or None on the step that ended the request with a stop id.
        hidden: ``[n, K, H]`` states of the model's ``hidden_layers`` of the tokens the step
            fed (the prompt's with frame 0, then the previous frame's token), on the device.
    """

    frame: torch.Tensor | None
    hidden: torch.Tensor


@dataclass(frozen=True)
class RowFeed:
    """What one message of a request asks of the engine, applied in this order.

    Attributes:
        start: add the request to the engine with this input (once per request).
        rows: ``[K, H]`` step rows to append (the request must have ``more_rows``).
        complete: no more rows will come.
        max_new_tokens: lower the request's frame cap to this
            (:meth:`~omnistage.engine.engine.AREngine.cap_new_tokens`), e.g. once its
            whole input is known.
        empty: the request ends with no frames (finish_reason ``"stop"``, a prompt of 0
            tokens) without entering the engine: it has nothing to generate (e.g. a talker
            whose reply has no text). Only for a request never started.
    """

    start: GenerationInput | None = None
    rows: torch.Tensor | None = None
    complete: bool = False
    max_new_tokens: int | None = None
    empty: bool = False


class StreamInput(ABC):
    """One request's payload and stream, as engine calls (see the module docstring).
    Each method raises a typed :class:`~omnistage.core.errors.OmnistageError`, ``ValueError``
    or ``TypeError`` for bad input, which fails the request."""

    @abstractmethod
    def on_payload(self, payload: StagePayload) -> RowFeed:
        """The stage payload arrived (before or after stream chunks)."""

    @abstractmethod
    def on_chunk(self, chunk: StreamChunk) -> RowFeed:
        """A stream chunk arrived."""

    @abstractmethod
    def on_done(self) -> RowFeed:
        """Every stream source finished."""

    def on_input_done(self) -> RowFeed:
        """The client sent the last of its input (a stage that takes client input; its
        chunks come to :meth:`on_chunk` with ``source``
        :data:`~omnistage.core.messages.CLIENT_SOURCE`).

        Raises:
            TypeError: this adapter takes no client input.
        """
        raise TypeError(f"{type(self).__name__} takes no client input")


class RowStream(StreamInput):
    """The default :class:`StreamInput`: the payload starts the request
    (``build_input(payload)``); each chunk's data is ``[K, H]`` step rows; stream-done
    completes them. Rows and done that arrive before the payload are kept until it does."""

    def __init__(self, build_input: Callable[[StagePayload], GenerationInput]) -> None:
        self.build_input = build_input
        self.started = self.done = False
        self.early: list[torch.Tensor] = []

    def on_payload(self, payload: StagePayload) -> RowFeed:
        self.started = True
        rows = torch.cat(self.early) if self.early else None
        self.early = []
        return RowFeed(self.build_input(payload), rows, self.done)

    def on_chunk(self, chunk: StreamChunk) -> RowFeed:
        if not isinstance(chunk.data, torch.Tensor):
            raise TypeError(f"a step-row chunk is a [K, H] tensor, got {type(chunk.data).__name__}")
        if self.started:
            return RowFeed(rows=chunk.data)
        self.early.append(chunk.data)
        return RowFeed()

    def on_done(self) -> RowFeed:
        self.done = True
        return RowFeed(complete=self.started)


_Item = tuple[str, "CodeFrames | FrameWithHidden | StopTail"]  # (request id, stream item)


@dataclass
class _StopWatch:
    """A request with stop strings: its matcher, prompt length, the outputs whose frames
    are held and the frames released so far."""

    matcher: StopStringMatcher
    prompt_len: int
    held: list[StepOutput]
    released: list[torch.Tensor]


@dataclass
class _Streamed:
    """A request at a stage with stream sources: its adapter, whether its payload arrived,
    and its result if that came first."""

    adapter: StreamInput
    has_payload: bool = False
    result: GenerationResult | None = None


class ARScheduler(Scheduler):
    """Args:
    engine: the engine (built on the stage's device).
    build_input: ``build_input(payload) -> GenerationInput``; raises a typed
        :class:`~omnistage.core.errors.OmnistageError`, ``ValueError`` or ``TypeError`` for bad input.
    stream_frames: stream each frame as :class:`CodeFrames` and end with a
        :class:`GenerationSummary`; False: end with the whole ``GenerationResult``.
    release_callback: see :class:`Scheduler` (the engine's own state is freed regardless).
    stream_input: ``stream_input(request_id) -> StreamInput``, used when the stage has
        stream sources (None: :class:`RowStream` over ``build_input``).
    token_text: the model's tokenizer, for requests with ``stop_strings`` (None: such a
        request fails with a ``ValueError``).
    """

    max_messages_per_tick = 256

    def __init__(
        self,
        engine: AREngine,
        build_input: Callable[[StagePayload], GenerationInput] = payload_data,
        stream_frames: bool = True,
        release_callback: Callable[[str], None] | None = None,
        stream_input: Callable[[str], StreamInput] | None = None,
        token_text: TokenText | None = None,
    ) -> None:
        super().__init__(release_callback)
        self.engine, self.build_input, self.stream_frames = engine, build_input, stream_frames
        self.stream_input = stream_input or (lambda request_id: RowStream(self.build_input))
        self.token_text = token_text
        self._streamed: dict[str, _Streamed] = {}
        self._watches: dict[str, _StopWatch] = {}
        self._ended = Tombstones()

    def live_requests(self) -> set[str]:
        return self.engine.live_requests() | set(self._streamed) | set(self._watches)

    def release(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._release_state(request_id)
        super().release(request_id)

    def _release_state(self, request_id: str) -> None:
        self._streamed.pop(request_id, None)
        self._watches.pop(request_id, None)
        self._ended.add(request_id)

    def _add_request(self, request_id: str, inputs: GenerationInput) -> None:
        """Raises: ValueError: stop strings at a stage without ``token_text`` or of a model
        with more than one code per frame; the engine's errors."""
        watch = None
        if inputs.stop_strings:
            if self.token_text is None:
                raise ValueError(f"stage {self.stage_name!r} takes no stop strings (it has no tokenizer)")
            if self.engine.runner.spec.num_code_groups != 1:
                raise ValueError("stop strings need a model of one token per frame")
            watch = _StopWatch(StopStringMatcher(inputs.stop_strings, self.token_text), int(inputs.prompt.shape[0]), [], [])
        self.engine.add_request(request_id, inputs)
        if watch is not None:
            self._watches[request_id] = watch

    def _run(self) -> None:
        while True:
            hint = self.engine.wait_hint()
            messages = self.take(block=hint != 0, limit=self.max_messages_per_tick, timeout=hint)
            for message in messages:
                if message is None:
                    return
                self._ingest(message)
            self._step()

    def _ingest(self, message: StageInput) -> None:
        request_id = message.request_id
        if isinstance(message, Abort):
            self.release(request_id)
        elif request_id in self._ended:
            return  # a late chunk or stream-done of a request that ended here
        elif self.expects_stream:
            self._ingest_streamed(message)
        elif isinstance(message, StagePayload):
            try:
                self._add_request(request_id, self.build_input(message))
            except (OmnistageError, ValueError, TypeError) as exc:
                self.outbox.fail(request_id, exc)
        else:
            self.outbox.fail(request_id, TypeError(f"stage {self.stage_name!r} takes no streams"))

    def _ingest_streamed(self, message: StagePayload | StreamChunk | StreamDone) -> None:
        request_id = message.request_id
        state = self._streamed.get(request_id)
        try:
            if state is None:
                state = self._streamed[request_id] = _Streamed(self.stream_input(request_id))
            if isinstance(message, StagePayload):
                state.has_payload = True
                feed = state.adapter.on_payload(message)
            elif isinstance(message, StreamChunk):
                feed = state.adapter.on_chunk(message)
            elif message.source == CLIENT_SOURCE:
                feed = state.adapter.on_input_done()
            else:
                feed = state.adapter.on_done()
            if feed.start is not None:
                self._add_request(request_id, feed.start)
            if feed.rows is not None:
                self.engine.append_step_rows(request_id, feed.rows)
            if feed.complete:
                self.engine.complete_step_rows(request_id)
            if feed.max_new_tokens is not None:
                self.engine.cap_new_tokens(request_id, feed.max_new_tokens)
            if feed.empty:
                if request_id in self.engine.live_requests():
                    raise ValueError("a started request cannot end empty")
                groups = self.engine.runner.spec.num_code_groups
                state.result = GenerationResult(torch.empty(0, groups, dtype=torch.int64), "stop", 0)
        except (OmnistageError, ValueError, TypeError) as exc:
            self.engine.abort(request_id)
            self._release_state(request_id)
            self.outbox.fail(request_id, exc)
            return
        if state.has_payload and state.result is not None:
            self._finish(request_id, state.result)

    def _step(self) -> None:
        plan = self.engine.schedule()
        if not plan.request_ids:
            return
        if plan.batch is not None and plan.batch.kind == "prefill":
            for seq in plan.batch.seqs:
                self.outbox.mark(seq.request_id, PREFILL_MARK)
        outputs: list[StepOutput] = []
        if not self.run_batch(plan.request_ids, lambda: outputs.extend(self.engine.execute(plan)), self.step_kind(plan)):
            return
        items: list[_Item] = []
        results: list[tuple[str, GenerationResult]] = []
        for out in outputs:
            watch = self._watches.get(out.request_id)
            if watch is not None:
                self._watch(watch, out, items, results)
                continue
            if out.hidden is not None or out.frame is not None:
                items.append((out.request_id, _frame_item(out)))
            if out.result is not None:
                results.append((out.request_id, out.result))
        if self.stream_frames and items:  # one message per stream target for the whole step
            self.outbox.stream_many(items)
        for request_id, result in results:
            self._on_result(request_id, result)

    @staticmethod
    def step_kind(plan: StepPlan) -> BatchKind:
        """What ``plan``'s step is, for the batch metrics: ``prefill`` (admitted requests
        alone), ``mixed`` (a prefill that also decodes the running requests), ``decode``, or
        ``drain`` (no launch: only the in-flight step is waited for, with the engine's
        overlap)."""
        batch = plan.batch
        if batch is None:
            return "drain"
        if batch.kind == "prefill" and batch.decode:
            return "mixed"
        return batch.kind

    def _watch(
        self, watch: _StopWatch, out: StepOutput, items: list[_Item], results: list[tuple[str, GenerationResult]]
    ) -> None:
        """One step's output of a request with stop strings (module docstring): the items
        it releases go to ``items``, its result, if it ended, to ``results``."""
        request_id = out.request_id
        if out.frame is not None:
            watch.held.append(out)
            verdict = watch.matcher.push(int(out.frame[0, 0]))
            if isinstance(verdict, StopMatch):
                self._stop(watch, out.request_id, verdict, items, results)
                return
            self._release(watch, verdict, items)
        if out.result is not None:
            self._release(watch, watch.matcher.flush(), items)
            if out.frame is None and out.hidden is not None:
                items.append((request_id, FrameWithHidden(None, out.hidden)))  # a stop id's last rows
            self._watches.pop(request_id)
            results.append((request_id, out.result))

    def _release(self, watch: _StopWatch, count: int, items: list[_Item]) -> None:
        released, watch.held = watch.held[:count], watch.held[count:]
        for out in released:
            assert out.frame is not None
            watch.released.append(out.frame)
            items.append((out.request_id, _frame_item(out)))

    def _stop(
        self, watch: _StopWatch, request_id: str, match: StopMatch, items: list[_Item],
        results: list[tuple[str, GenerationResult]],
    ) -> None:  # fmt: skip
        self.engine.stop(request_id)
        assert match.kept < len(watch.held)  # the last token holds (the end of) the stop string
        first_cut = watch.held[match.kept]  # the token the stop string begins in
        self._release(watch, match.kept, items)
        if first_cut.hidden is not None:  # the rows of the last kept token came with it
            items.append((request_id, FrameWithHidden(None, first_cut.hidden)))
        tail = torch.tensor(match.tail, dtype=torch.int64)
        if match.tail:
            items.append((request_id, StopTail(tail)))
        self._watches.pop(request_id)
        codes = torch.cat([*watch.released, tail[:, None]])
        results.append((request_id, GenerationResult(codes, "stop", watch.prompt_len)))

    def _on_result(self, request_id: str, result: GenerationResult) -> None:
        state = self._streamed.get(request_id)
        if state is not None and not state.has_payload:
            state.result = result  # delivered once the payload arrives
            return
        self._finish(request_id, result)

    def _finish(self, request_id: str, result: GenerationResult) -> None:
        self._release_state(request_id)
        data = GenerationSummary(result.codes.shape[0], result.num_prompt_tokens) if self.stream_frames else result
        self.outbox.result(request_id, data, result.finish_reason)
