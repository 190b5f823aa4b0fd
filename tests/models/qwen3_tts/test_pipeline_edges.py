"""Every edge of the Qwen3-TTS pipeline says what it carries."""

from pathlib import Path

from omnistage.core.payloads import AudioChunk
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.pipeline.pipeline import build_topology
from omnistage.scheduling.ar import CodeFrames, GenerationSummary
from omnistage.scheduling.vocoder import VocoderSetup


def test_every_edge_is_typed(tiny_checkpoints: dict[str, Path]):
    topology = build_topology(Qwen3TTSPipelineConfig.for_model_path(str(tiny_checkpoints["base"])))
    edges = {(e.source, e.target, e.kind): e.carries for e in topology.edges}
    assert edges == {
        ("preprocessing", "tts_engine", "next"): (GenerationInput,),
        ("preprocessing", "vocoder", "stream"): (VocoderSetup,),
        ("tts_engine", "vocoder", "next"): (GenerationSummary,),
        ("tts_engine", "vocoder", "stream"): (CodeFrames,),
    }
    assert topology.types["vocoder"].streams == (AudioChunk,)
