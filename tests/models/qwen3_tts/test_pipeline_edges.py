"""Every edge of the Qwen3-TTS pipeline says what it carries; Base checkpoints encode
reference clips in a batching stage of their own."""

from pathlib import Path

from omnistage.core.payloads import AudioChunk, InputText
from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.models.qwen3_tts.payload_types import EncodedReference, TalkerStart
from omnistage.pipeline.pipeline import build_topology
from omnistage.scheduling.ar import CodeFrames, GenerationSummary
from omnistage.scheduling.vocoder import VocoderSetup


def test_every_edge_is_typed(tiny_checkpoints: dict[str, Path]):
    topology = build_topology(Qwen3TTSPipelineConfig.for_model_path(str(tiny_checkpoints["base"])))
    edges = {(e.source, e.target, e.kind): e.carries for e in topology.edges}
    assert edges == {
        ("reference_encoder", "preprocessing", "next"): (EncodedReference,),
        ("preprocessing", "tts_engine", "next"): (TalkerStart,),
        ("preprocessing", "vocoder", "stream"): (VocoderSetup,),
        ("tts_engine", "vocoder", "next"): (GenerationSummary,),
        ("tts_engine", "vocoder", "stream"): (CodeFrames,),
    }
    assert topology.types["vocoder"].streams == (AudioChunk,)
    assert topology.client_input_stage == "tts_engine"  # a live session's text goes there
    assert topology.types["tts_engine"].client_input == (InputText,)


def test_only_base_checkpoints_encode_references(tiny_checkpoints: dict[str, Path]):
    for model_type, path in tiny_checkpoints.items():
        topology = build_topology(Qwen3TTSPipelineConfig.for_model_path(str(path)))
        assert ("reference_encoder" in topology.stages) == (model_type == "base"), model_type
        assert topology.entry == ("reference_encoder" if model_type == "base" else "preprocessing")
