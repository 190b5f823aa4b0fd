"""The toy AR model (:mod:`omnistage.testing.toy_ar`) served as a pipeline stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.config.pipeline import FactoryConfig, PipelineConfig, StageConfig
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput, GenerationResult
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling import StreamingScheduler, StreamState
from omnistage.scheduling.ar import ARScheduler
from omnistage.testing.toy_ar import ToyARConfig, ToyTalker


@dataclass(frozen=True)
class ToyARRequest:
    """A request for :func:`toy_ar_stage`: a random prompt from ``seed``."""

    prompt_len: int
    max_new_tokens: int
    seed: int = 0
    sampling: SamplingParams = SamplingParams(temperature=0.0)


def toy_ar_input(request: ToyARRequest, hidden_size: int = ToyARConfig.hidden_size,
                 dtype: torch.dtype = torch.float64) -> GenerationInput:
    g = torch.Generator().manual_seed(request.seed)
    return GenerationInput(
        torch.randn(request.prompt_len, hidden_size, generator=g, dtype=dtype), request.sampling,
        request.max_new_tokens, step_embeds=torch.randn(2, hidden_size, generator=g, dtype=dtype),
        pad_embed=torch.randn(hidden_size, generator=g, dtype=dtype),
    )


def toy_ar_model() -> ToyTalker:
    """The model :func:`toy_ar_stage` serves (fp64, so batching never flips a greedy code)."""
    return ToyTalker(ToyARConfig(), torch.float64)


def toy_ar_stage(ctx: StageBuildContext, max_num_seqs: int = 4, kv_cache_bytes: int = 1 << 20) -> ARScheduler:
    """An AR stage over :func:`toy_ar_model`; takes :class:`ToyARRequest` requests."""
    engine = AREngine(toy_ar_model(), EngineConfig(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs,
                                                   max_model_len=1024, prefill_hold_ms=1.0))
    return ARScheduler(engine, build_input=lambda payload: toy_ar_input(payload.request))


class _CollectFrames(StreamingScheduler):
    """Terminal: passes every frame on to the client; result ``(streamed [T, G], the AR
    stage's GenerationResult)``."""

    def step(self, states: list[StreamState]) -> None:
        for state in states:
            frames = state.model_state = state.model_state or []
            for chunk in state.chunks:
                frames.append(chunk.data)
                self.emit(state, chunk.data, chunk.modality)
            state.chunks.clear()
            if self.ready_to_finish(state):
                assert state.payload is not None
                result: GenerationResult = state.payload.data
                streamed = torch.cat(frames) if frames else result.codes[:0]
                self.complete(state, (streamed, result), result.finish_reason)


def collect_frames(ctx: StageBuildContext) -> _CollectFrames:
    return _CollectFrames()


def ar_pipeline_config(**engine_args: int) -> PipelineConfig:
    """``engine`` (the toy AR stage, streaming frames) -> ``collect`` (terminal)."""
    here = "omnistage.testing.toy_ar_stage:"
    return PipelineConfig(
        name="toy-ar",
        stages=[
            StageConfig(name="engine", factory=FactoryConfig(path=here + "toy_ar_stage", args=engine_args),
                        next="collect", stream_to=["collect"]),
            StageConfig(name="collect", factory=FactoryConfig(path=here + "collect_frames"), terminal=True,
                        can_accept_stream_before_payload=True),
        ],
    )
