"""The toy AR model (:mod:`omnistage.testing.toy_ar`) served as a pipeline stage, alone
(:func:`ar_pipeline_config`) or fed step rows by a stage that streams them into the
running requests (:func:`ar_stream_pipeline_config`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import torch

from omnistage.config.pipeline import FactoryConfig, PipelineConfig, StageConfig
from omnistage.core.messages import StagePayload, StreamChunk
from omnistage.core.request import PipelineRequest
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling import StreamingScheduler, StreamState, ThreadedScheduler
from omnistage.scheduling.ar import (
    ARScheduler,
    FrameWithHidden,
    GenerationSummary,
    RowFeed,
    StreamInput,
)
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker


@dataclass(frozen=True)
class ToyARRequest(PipelineRequest):
    """A request for :func:`toy_ar_stage`: a random prompt and ``rows`` step rows from
    ``seed``. In :func:`ar_stream_pipeline_config`, ``given`` rows come with the request
    and the rest are streamed in one by one, each once :data:`ROW_GATES` lets it pass
    (``gated``) or at once."""

    prompt_len: int
    max_new_tokens: int
    seed: int = 0
    sampling: SamplingParams = SamplingParams(temperature=0.0)
    rows: int = 2
    given: int = 0
    gated: bool = False
    token_ids: bool = False
    return_hidden: bool = False


def toy_ar_input(request: ToyARRequest, hidden_size: int = ToyARConfig.hidden_size,
                 dtype: torch.dtype = torch.float64) -> GenerationInput:
    """The request with all its rows (what the streamed rows must reproduce); the prompt
    is token ids if ``request.token_ids``, else embeddings."""
    g = torch.Generator().manual_seed(request.seed)
    if request.token_ids:
        prompt = torch.randint(0, ToyARConfig.vocab_size, (request.prompt_len,), generator=g)
    else:
        prompt = torch.randn(request.prompt_len, hidden_size, generator=g, dtype=dtype)
    return GenerationInput(
        prompt, request.sampling, request.max_new_tokens,
        step_rows=torch.randn(request.rows, hidden_size, generator=g, dtype=dtype),
        pad_embed=torch.randn(hidden_size, generator=g, dtype=dtype), return_hidden=request.return_hidden,
    )


class RowGates:
    """Per-request permits for the row feeder (in-process tests): a gated request's next
    row is sent once :meth:`allow` granted it."""

    def __init__(self) -> None:
        self._permits: dict[int, threading.Semaphore] = {}
        self._lock = threading.Lock()

    def _semaphore(self, seed: int) -> threading.Semaphore:
        with self._lock:
            return self._permits.setdefault(seed, threading.Semaphore(0))

    def allow(self, seed: int, rows: int = 1) -> None:
        self._semaphore(seed).release(rows)

    def wait(self, seed: int, timeout: float = 30.0) -> None:
        if not self._semaphore(seed).acquire(timeout=timeout):
            raise TimeoutError(f"row {seed} was never allowed")


ROW_GATES = RowGates()


def toy_row_feeder(ctx: StageBuildContext, start_in_payload: bool = False) -> ThreadedScheduler:
    """Streams a :class:`ToyARRequest`'s rows to the engine stage: first (unless
    ``start_in_payload``) its start, a :class:`GenerationInput` with the ``given`` rows
    and ``more_rows``, then every other row as a ``[1, H]`` tensor. Result: the start when ``start_in_payload``, else
    None."""
    scheduler: ThreadedScheduler

    def compute(payload: StagePayload) -> GenerationInput | None:
        request: ToyARRequest = payload.request
        full = toy_ar_input(request)
        assert full.step_rows is not None
        head = full.step_rows[: request.given] if request.given else None
        start = replace(full, step_rows=head, more_rows=True)
        if not start_in_payload:
            scheduler.outbox.stream(payload.request_id, start)
        for row in full.step_rows[request.given :]:
            if request.gated:
                ROW_GATES.wait(request.seed)
            scheduler.outbox.stream(payload.request_id, row[None])
        return start if start_in_payload else None

    scheduler = ThreadedScheduler(compute, num_workers=8)
    return scheduler


class ToyStreamStart(StreamInput):
    """The engine stage's hand-off from :func:`toy_row_feeder` (a model-specific
    :class:`StreamInput`): the first chunk starts the request, later chunks are rows."""

    def on_payload(self, payload: StagePayload) -> RowFeed:
        return RowFeed()

    def on_chunk(self, chunk: StreamChunk) -> RowFeed:
        if isinstance(chunk.data, GenerationInput):
            return RowFeed(start=chunk.data)
        return RowFeed(rows=chunk.data)

    def on_done(self) -> RowFeed:
        return RowFeed(complete=True)


def toy_ar_model(num_code_groups: int = ToyARConfig.num_code_groups, hidden_layers: tuple[int, ...] = ()) -> ToyTalker:
    """The model :func:`toy_ar_stage` serves (fp64, so batching never flips a greedy code)."""
    return ToyTalker(ToyARConfig(num_code_groups=num_code_groups, hidden_layers=hidden_layers), torch.float64)


def toy_ar_stage(ctx: StageBuildContext, max_num_seqs: int = 4, kv_cache_bytes: int = 1 << 20,
                 start: str = "request", num_code_groups: int = ToyARConfig.num_code_groups,
                 hidden_layers: tuple[int, ...] = (), overlap: bool | None = None) -> ARScheduler:
    """An AR stage over :func:`toy_ar_model` (``num_code_groups`` 1: a plain token LM;
    ``hidden_layers``: the states it can return; ``overlap``: the engine's
    :attr:`~omnistage.engine.engine.EngineConfig.overlap`, None: off on the CPU).
    ``start``: where a request's input comes from: ``"request"`` (built from the
    :class:`ToyARRequest`), or, fed by :func:`toy_row_feeder`, ``"payload"`` (its result)
    or ``"chunk"`` (its first chunk)."""
    config = EngineConfig(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs, max_model_len=1024,
                          prefill_hold_ms=1.0, overlap=overlap)
    engine = AREngine(toy_ar_model(num_code_groups, tuple(hidden_layers)), config)
    if start == "chunk":
        return ARScheduler(engine, stream_input=lambda request_id: ToyStreamStart())
    if start == "payload":
        return ARScheduler(engine)
    return ARScheduler(engine, build_input=lambda payload: toy_ar_input(payload.request))


SUMMARY = "omnistage.scheduling.ar:GenerationSummary"
FRAMES = ["omnistage.scheduling.ar:CodeFrames", "omnistage.scheduling.ar:FrameWithHidden"]


class _CollectFrames(StreamingScheduler[list[torch.Tensor]]):
    """Terminal: passes every chunk on to the client; result ``(streamed frames [T, G],
    the AR stage's GenerationSummary)``."""

    def __init__(self, num_code_groups: int) -> None:
        super().__init__()
        self.num_code_groups = num_code_groups

    def step(self, states: list[StreamState]) -> None:
        for state in states:
            frames = state.model_state = state.model_state or []
            for chunk in state.chunks:
                frame = chunk.data.frame if isinstance(chunk.data, FrameWithHidden) else chunk.data.codes
                if frame is not None:
                    frames.append(frame)
                self.emit(state, chunk.data)
            state.chunks.clear()
            if self.ready_to_finish(state):
                assert state.payload is not None
                summary: GenerationSummary = state.payload.data
                streamed = torch.cat(frames) if frames else torch.zeros(0, self.num_code_groups, dtype=torch.int64)
                self.complete(state, (streamed, summary))


def collect_frames(ctx: StageBuildContext, num_code_groups: int = ToyARConfig.num_code_groups) -> _CollectFrames:
    return _CollectFrames(num_code_groups)


def ar_pipeline_config(engine_process: str | None = None, **engine_args: object) -> PipelineConfig:
    """``engine`` (the toy AR stage, streaming frames; in process group ``engine_process``,
    None: the server's) -> ``collect`` (terminal)."""
    here = "omnistage.testing.toy_ar_stage:"
    collect_args = {"num_code_groups": engine_args.get("num_code_groups", ToyARConfig.num_code_groups)}
    return PipelineConfig(
        name="toy-ar",
        stages=[
            StageConfig(name="engine", factory=FactoryConfig(path=here + "toy_ar_stage", args=engine_args),
                        next="collect", stream_to=["collect"], process=engine_process, result_type=SUMMARY,
                        stream_types=FRAMES),
            StageConfig(name="collect", factory=FactoryConfig(path=here + "collect_frames", args=collect_args),
                        terminal=True, can_accept_stream_before_payload=True, payload_type=SUMMARY,
                        accepts_stream_types=FRAMES, stream_types=FRAMES),
        ],
    )


def ar_stream_pipeline_config(start_in_payload: bool = False, **engine_args: object) -> PipelineConfig:
    """``feed`` (streams step rows into ``engine``) -> ``engine`` (the toy AR stage) ->
    ``collect`` (terminal). The engine request starts from the first chunk, or with
    ``start_in_payload`` from the feeder's result."""
    here = "omnistage.testing.toy_ar_stage:"
    engine = {"start": "payload" if start_in_payload else "chunk", **engine_args}
    collect_args = {"num_code_groups": engine_args.get("num_code_groups", ToyARConfig.num_code_groups)}
    return PipelineConfig(
        name="toy-ar-stream",
        stages=[
            StageConfig(name="feed", factory=FactoryConfig(path=here + "toy_row_feeder",
                                                           args={"start_in_payload": start_in_payload}),
                        next="engine", stream_to=["engine"]),
            StageConfig(name="engine", factory=FactoryConfig(path=here + "toy_ar_stage", args=engine),
                        next="collect", stream_to=["collect"], can_accept_stream_before_payload=True,
                        result_type=SUMMARY, stream_types=FRAMES),
            StageConfig(name="collect", factory=FactoryConfig(path=here + "collect_frames", args=collect_args),
                        terminal=True, can_accept_stream_before_payload=True, payload_type=SUMMARY,
                        accepts_stream_types=FRAMES, stream_types=FRAMES),
        ],
    )
