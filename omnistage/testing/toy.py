"""Toy stages and topologies used by the runtime's tests (CPU, deterministic).

``ToyRequest.text`` drives them: the characters are the data, ``"FAIL"`` makes the
``double`` stage raise ``RuntimeError``, ``"OOM"`` makes it raise
``torch.OutOfMemoryError``; ``delay_s`` slows the ``double`` stage down (for abort races).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from omnistage.config.pipeline import FactoryConfig, PipelineConfig, StageConfig
from omnistage.core.errors import OmnistageError
from omnistage.core.messages import StageInput, StagePayload
from omnistage.core.request import PipelineRequest
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling import (
    ItemFailure,
    SimpleScheduler,
    StreamingScheduler,
    StreamState,
    ThreadedScheduler,
)


@dataclass(frozen=True)
class ToyRequest(PipelineRequest):
    text: str
    image: bool = False
    audio_in: bool = False
    audio_out: bool = True
    delay_s: float = 0.0


@dataclass
class Released:
    """Records release_callback calls per stage (tests read it)."""

    calls: dict[str, list[str]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, stage: str, request_id: str) -> None:
        with self.lock:
            self.calls.setdefault(stage, []).append(request_id)


RELEASED = Released()
BATCH_SIZES: list[int] = []  # batch sizes the `double` stage computed (in-process)


class Gates:
    """Hold a stage's compute for a request text until the test releases it (in-process)."""

    def __init__(self) -> None:
        self.entered: dict[str, threading.Event] = {}
        self.opened: dict[str, threading.Event] = {}

    def close(self, key: str) -> None:
        self.entered[key], self.opened[key] = threading.Event(), threading.Event()

    def open(self, key: str) -> None:
        self.opened[key].set()

    def wait_entered(self, key: str, timeout: float = 10.0) -> bool:
        return self.entered[key].wait(timeout)

    def pass_through(self, key: str) -> None:
        if key in self.opened:
            self.entered[key].set()
            self.opened[key].wait(10.0)


GATES = Gates()


def _release(stage: str):
    return lambda request_id: RELEASED.record(stage, request_id)


# ------------------------------------------------------------------ stage factories
def encode(ctx: StageBuildContext, max_batch_size: int = 4, max_batch_wait_ms: float = 2.0) -> SimpleScheduler:
    """text -> ``[len] int64`` character codes."""

    def compute(batch: list[StagePayload]) -> list[object]:
        out: list[object] = []
        for p in batch:
            text = p.request.text
            out.append(ItemFailure(ValueError("bad item")) if "BADITEM" in text else torch.tensor([ord(c) for c in text]))
        return out

    return SimpleScheduler(compute, max_batch_size, max_batch_wait_ms, release_callback=_release(ctx.stage.name))


def double(ctx: StageBuildContext, chunk_size: int = 3, max_batch_size: int = 4) -> SimpleScheduler:
    """Streams ``codes * 2`` in chunks of ``chunk_size``; result: the number of codes."""
    scheduler = SimpleScheduler(lambda batch: [], max_batch_size, 2.0, release_callback=_release(ctx.stage.name))

    def compute(batch: list[StagePayload]) -> list[object]:
        BATCH_SIZES.append(len(batch))
        for p in batch:
            if "OOM" in p.request.text:
                raise torch.OutOfMemoryError("toy: CUDA out of memory")
            if "FAIL" in p.request.text:
                raise RuntimeError("toy failure")
        out: list[object] = []
        for p in batch:
            time.sleep(p.request.delay_s)
            codes: torch.Tensor = p.data
            for i in range(0, len(codes), chunk_size):
                scheduler.outbox.stream(p.request_id, codes[i : i + chunk_size] * 2)
            out.append(len(codes))
        return out

    scheduler.compute = compute
    return scheduler


class _Accumulate(StreamingScheduler[int]):
    """Emits ``chunk + 1`` for every chunk; result: the sum of all emitted values."""

    def step(self, states: list[StreamState]) -> None:
        for state in states:
            total = state.model_state or 0
            for chunk in state.chunks:
                out = chunk.data + 1
                total += int(out.sum())
                self.emit(state, out)
            state.chunks.clear()
            state.model_state = total
            if self.ready_to_finish(state):
                self.complete(state, total)


def accumulate(ctx: StageBuildContext) -> _Accumulate:
    return _Accumulate(release_callback=_release(ctx.stage.name))


def hold(ctx: StageBuildContext) -> SimpleScheduler:
    """One at a time: waits at its gate, result: the request text."""

    def compute(batch: list[StagePayload]) -> list[object]:
        for p in batch:
            GATES.pass_through(f"{ctx.stage.name}:{p.request.text}")
        return [p.request.text for p in batch]

    return SimpleScheduler(compute, 1, 0.0, release_callback=_release(ctx.stage.name))


def tag(ctx: StageBuildContext, label: str = "", num_workers: int = 4) -> ThreadedScheduler:
    """Threaded stage: result ``(label, request text)`` after ``request.delay_s``."""

    def compute(p: StagePayload) -> object:
        GATES.pass_through(f"{ctx.stage.name}:{p.request.text}")
        time.sleep(p.request.delay_s)
        return (label or ctx.stage.name, p.request.text)

    return ThreadedScheduler(compute, num_workers, release_callback=_release(ctx.stage.name))


# ---------------------------------------------------------------- linear pipeline
def _stage(name: str, factory: str, **kwargs: object) -> StageConfig:
    args = kwargs.pop("args", {})
    return StageConfig(name=name, factory=FactoryConfig(path=f"omnistage.testing.toy:{factory}", args=args), **kwargs)


def linear_config(process: dict[str, str] | None = None, **overrides: object) -> PipelineConfig:
    """encode -> double (streams to accumulate) -> accumulate (terminal, streaming)."""
    process = process or {}
    return PipelineConfig(
        name="toy-linear",
        stages=[
            _stage("encode", "encode", next="double", process=process.get("encode")),
            _stage("double", "double", next="accumulate", stream_to=["accumulate"], process=process.get("double")),
            _stage(
                "accumulate", "accumulate", terminal=True, can_accept_stream_before_payload=True,
                process=process.get("accumulate"),
            ),
        ],
        **overrides,
    )


def expected_linear(text: str, chunk_size: int = 3) -> tuple[list[list[int]], int]:
    """Exact client chunks and result of :func:`linear_config` for ``text``."""
    codes = [ord(c) for c in text]
    chunks = [[2 * c + 1 for c in codes[i : i + chunk_size]] for i in range(0, len(codes), chunk_size)]
    return chunks, sum(sum(c) for c in chunks)


# ------------------------------------------------------ Qwen3-Omni routing topology
def wants_audio(request: ToyRequest) -> bool:
    """The one per-request decision every Omni hook derives from."""
    return request.audio_out


def omni_route_preprocessing(payload: StagePayload) -> list[str]:
    r = payload.request
    return ["thinker"] + ["image_encoder"] * r.image + ["audio_encoder"] * r.audio_in


def omni_thinker_waits(payload: StagePayload) -> list[str]:
    r = payload.request
    return ["preprocessing"] + ["image_encoder"] * r.image + ["audio_encoder"] * r.audio_in


def omni_merge(payloads: dict[str, StagePayload]) -> torch.Tensor:
    """The thinker's input: the request text as codes (all sources carry the request)."""
    request = next(iter(payloads.values())).request
    return torch.tensor([ord(c) for c in request.text])


def omni_route_thinker(payload: StagePayload) -> list[str]:
    return ["decode", "talker"] if wants_audio(payload.request) else ["decode"]


def omni_thinker_streams(payload: StagePayload) -> list[str]:
    return ["talker"] if wants_audio(payload.request) else []


def omni_terminals(request: ToyRequest) -> list[str]:
    return ["decode", "code2wav"] if wants_audio(request) else ["decode"]


def omni_samples() -> list[tuple[str, ToyRequest]]:
    return [
        ("text-only", ToyRequest("hi", audio_out=False)),
        ("text+audio", ToyRequest("hi", audio_in=True)),
        ("text+image", ToyRequest("hi", image=True, audio_out=False)),
        ("all", ToyRequest("hi", image=True, audio_in=True)),
    ]


def omni_config(process: dict[str, str] | None = None, **overrides: object) -> PipelineConfig:
    """Seed 001's Qwen3-Omni topology with toy stages: preprocessing -> image/audio
    encoders -> thinker (fan-in) -> decode (terminal, text); thinker streams to talker ->
    code2wav (terminal, audio). Text-only requests skip talker and code2wav."""
    p = process or {}
    hooks = "omnistage.testing.toy:"
    return PipelineConfig(
        name="toy-omni",
        stages=[
            _stage("preprocessing", "tag", next=["image_encoder", "audio_encoder", "thinker"],
                   route_fn=hooks + "omni_route_preprocessing", process=p.get("preprocessing")),
            _stage("image_encoder", "tag", next="thinker", process=p.get("image_encoder")),
            _stage("audio_encoder", "tag", next="thinker", process=p.get("audio_encoder")),
            _stage("thinker", "double", next=["decode", "talker"], route_fn=hooks + "omni_route_thinker",
                   wait_for=["preprocessing", "image_encoder", "audio_encoder"],
                   wait_for_fn=hooks + "omni_thinker_waits", merge_fn=hooks + "omni_merge",
                   stream_to=["talker"], stream_done_to_fn=hooks + "omni_thinker_streams",
                   process=p.get("thinker")),
            _stage("talker", "accumulate", next="code2wav", stream_to=["code2wav"],
                   can_accept_stream_before_payload=True, process=p.get("talker")),
            _stage("decode", "tag", terminal=True, process=p.get("decode")),
            _stage("code2wav", "accumulate", terminal=True, can_accept_stream_before_payload=True,
                   process=p.get("code2wav")),
        ],
        terminal_stages_fn=hooks + "omni_terminals",
        sample_requests_fn=hooks + "omni_samples",
        **overrides,
    )


def expected_omni(request: ToyRequest, chunk_size: int = 3) -> tuple[dict[str, object], list[list[int]]]:
    """Exact terminal outputs and client audio chunks of :func:`omni_config`."""
    outputs: dict[str, object] = {"decode": ("decode", request.text)}
    chunks: list[list[int]] = []
    if request.audio_out:
        codes = [ord(c) for c in request.text]
        chunks = [[2 * c + 2 for c in codes[i : i + chunk_size]] for i in range(0, len(codes), chunk_size)]
        outputs["code2wav"] = sum(sum(c) for c in chunks)
    return outputs, chunks


def omni_wait_all(payload: StagePayload) -> list[str]:
    """A misconfigured ``wait_for_fn``: waits for both encoders whatever the request."""
    return ["preprocessing", "image_encoder", "audio_encoder"]


def route_nowhere(payload: StagePayload) -> str:
    """A misbehaving ``route_fn``: names a stage outside ``next``."""
    return "nowhere"


# ------------------------------------------------------------ tensor placement
def make_tensor(ctx: StageBuildContext, numel: int = 1 << 16) -> SimpleScheduler:
    """Result: ``(tensor, data_ptr)``, a float32 ``arange`` on the stage's device."""

    def compute(batch: list[StagePayload]) -> list[object]:
        out: list[object] = []
        for _ in batch:
            tensor = torch.arange(numel, dtype=torch.float32, device=ctx.stage.device)
            out.append((tensor, tensor.data_ptr()))
        return out

    return SimpleScheduler(compute)


def inspect_tensor(ctx: StageBuildContext) -> SimpleScheduler:
    """Result: ``(device, same_memory, sum)`` of the tensor the previous stage made."""

    def compute(batch: list[StagePayload]) -> list[object]:
        return [(str(p.data[0].device), p.data[0].data_ptr() == p.data[1], float(p.data[0].sum())) for p in batch]

    return SimpleScheduler(compute)


def tensor_config(device: str, processes: tuple[str | None, str | None]) -> PipelineConfig:
    """make_tensor -> inspect_tensor, each in the given process group."""
    return PipelineConfig(
        name="toy-tensor",
        stages=[
            _stage("make", "make_tensor", next="inspect", device=device, process=processes[0]),
            _stage("inspect", "inspect_tensor", terminal=True, device=device, process=processes[1]),
        ],
    )


# ------------------------------------------------------------ failure injection
class ToyQuotaError(OmnistageError):
    """A model-defined typed error whose ``__init__`` takes two arguments."""

    http_status = 429

    def __init__(self, who: str, limit: int) -> None:
        self.who, self.limit = who, limit
        super().__init__(f"{who} is over its quota of {limit}")


def misbehave(ctx: StageBuildContext) -> SimpleScheduler:
    """Result: the request text, except: ``"LOCK"`` returns an object that cannot cross
    processes, ``"QUOTA"`` raises :class:`ToyQuotaError`."""

    def compute(batch: list[StagePayload]) -> list[object]:
        out: list[object] = []
        for p in batch:
            if "QUOTA" in p.request.text:
                raise ToyQuotaError("toy", 3)
            out.append(threading.Lock() if "LOCK" in p.request.text else p.request.text)
        return out

    return SimpleScheduler(compute)


class _CrashingScheduler(SimpleScheduler):
    """A scheduler with a bug outside its batch boundary for ``"CRASH"`` requests."""

    def _accept(self, message: StageInput) -> None:
        if isinstance(message, StagePayload) and "CRASH" in message.request.text:
            raise RuntimeError("scheduler bug")
        super()._accept(message)


def crashing(ctx: StageBuildContext) -> SimpleScheduler:
    return _CrashingScheduler(lambda batch: [p.request.text for p in batch])


def broken_factory(ctx: StageBuildContext) -> SimpleScheduler:
    raise KeyError("a factory that fails to build")


def omni_route_thinker_mismatch(payload: StagePayload) -> list[str]:
    """Agrees with the other hooks on the sample requests, not on a text containing
    ``"MISMATCH"`` (it then also routes to the talker, which the terminal set omits)."""
    audio = wants_audio(payload.request) or "MISMATCH" in payload.request.text
    return ["decode", "talker"] if audio else ["decode"]


def omni_streams_mismatch(payload: StagePayload) -> list[str]:
    return ["talker"] if "talker" in omni_route_thinker_mismatch(payload) else []


def two_stage_config(first: str, second: str, processes: tuple[str | None, str | None] = (None, None)) -> PipelineConfig:
    """``a`` (factory ``first``) -> ``b`` (factory ``second``, terminal)."""
    return PipelineConfig(
        name="toy-two",
        stages=[
            _stage("a", first, next="b", process=processes[0]),
            _stage("b", second, terminal=True, process=processes[1]),
        ],
    )
