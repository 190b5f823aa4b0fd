"""Typed parse of a Qwen3-Omni checkpoint's ``config.json``: the one place the package reads it.

Architecture ``Qwen3OmniMoeForConditionalGeneration`` (``model_type`` ``qwen3_omni_moe``), with
the sub-configs ``thinker_config`` {``text_config``, ``audio_config``, ``vision_config``},
``talker_config`` {``text_config``, ``code_predictor_config``} and ``code2wav_config``
(shared/reference/qwen3-omni.md, section 1).

Every field a shape or a token id depends on is read from the file; a missing one is an error.
The reference's config classes carry defaults that are wrong for the real checkpoint (its
``head_dim`` falls back to hidden/heads = 64 where the model has 128; digest section 7), so the
only defaults kept are those of fields the shipped configs leave out and the reference reads
with a documented default (``attention_bias`` false, ``decoder_sparse_step`` 1,
``mlp_only_layers`` empty).

RoPE comes in two spellings and both are accepted: the Hub's ``rope_scaling`` dict plus a
sibling ``rope_theta``, and transformers 5's ``rope_parameters`` dict holding ``rope_theta``.
Only the default RoPE type is implemented; the thinker and talker use MRoPE with an interleaved
section assignment (transformers always interleaves: ``recomposition_frequencies``), so a file
that declares ``interleaved: false`` is refused rather than run as something else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.checkpoint.config_json import (
    CheckpointConfigError,
    load_json,
    read_json_object,
)
from omnistage.checkpoint.config_json import require as _require
from omnistage.engine.layers import CodePredictorConfig, DecoderConfig
from omnistage.models.qwen3_omni.modeling.audio_encoder import AudioEncoderConfig
from omnistage.models.qwen3_omni.modeling.code2wav import Code2WavConfig
from omnistage.models.qwen3_omni.modeling.vision_encoder import VisionEncoderConfig

__all__ = [
    "ARCHITECTURE",
    "CONFIG_FILE",
    "CheckpointConfigError",
    "MoEDecoderConfig",
    "Qwen3OmniConfig",
    "RopeConfig",
    "TalkerConfig",
    "ThinkerConfig",
    "load_config",
    "read_config_json",
]

CONFIG_FILE = "config.json"
ARCHITECTURE = "Qwen3OmniMoeForConditionalGeneration"


def _positive(value: int | float, field: str) -> None:
    if not value > 0:
        raise CheckpointConfigError(f"{field} = {value!r} must be > 0")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one decoder stack.

    Attributes:
        theta: base of the inverse frequencies ``theta ** (-2j / head_dim)``.
        mrope_section: ``(T, H, W)`` frequency counts of the multimodal RoPE (sum = head_dim/2),
            or None for the plain 1-D RoPE (code predictor).
    """

    theta: float
    mrope_section: tuple[int, int, int] | None

    @classmethod
    def parse(
        cls, section: dict[str, Any], where: str, head_dim: int, multimodal: bool
    ) -> RopeConfig:
        """From ``rope_parameters`` or ``rope_scaling`` + ``rope_theta`` of ``section``.

        Raises: CheckpointConfigError when neither form is present, the RoPE type is not
        ``default``, theta is not positive, or (``multimodal``) the section is missing, not
        three non-negative ints summing to head_dim/2, or declared non-interleaved.
        """
        if isinstance(section.get("rope_parameters"), dict):
            rope, rope_where = section["rope_parameters"], f"{where}.rope_parameters"
            theta = _require(rope, "rope_theta", rope_where, float)
        elif "rope_theta" in section:
            rope, rope_where = section.get("rope_scaling") or {}, f"{where}.rope_scaling"
            if not isinstance(rope, dict):
                raise CheckpointConfigError(f"{rope_where} is not a JSON object")
            theta = _require(section, "rope_theta", where, float)
        else:
            raise CheckpointConfigError(
                f"{where} has neither rope_parameters nor rope_theta (with rope_scaling)"
            )
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointConfigError(
                f"{rope_where}.rope_type = {rope_type!r}; only 'default' RoPE is supported"
            )
        _positive(theta, f"{rope_where}.rope_theta")
        if not multimodal:
            return cls(theta=theta, mrope_section=None)
        raw = _require(rope, "mrope_section", rope_where)
        if not (
            isinstance(raw, list)
            and len(raw) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw)
        ):
            raise CheckpointConfigError(
                f"{rope_where}.mrope_section = {raw!r} is not three non-negative ints"
            )
        if sum(raw) != head_dim // 2:
            raise CheckpointConfigError(
                f"{rope_where}.mrope_section {raw} does not sum to head_dim/2 = {head_dim // 2}"
            )
        for key in ("interleaved", "mrope_interleaved"):
            if rope.get(key, True) is not True:
                raise CheckpointConfigError(
                    f"{rope_where}.{key} is {rope[key]!r}; only interleaved MRoPE is implemented"
                )
        return cls(theta=theta, mrope_section=(raw[0], raw[1], raw[2]))


@dataclass(frozen=True)
class MoEDecoderConfig:
    """A Qwen3-MoE decoder stack (thinker text model or talker).

    Attributes:
        intermediate_size: width of the dense MLP of ``mlp_only_layers`` (and of layers skipped by
            ``decoder_sparse_step``); the talker reads it for its projections instead.
        num_experts, top_k, moe_intermediate_size, norm_topk_prob: the routed experts (softmax
            over ``num_experts`` router logits, top ``top_k``, renormalized when ``norm_topk_prob``).
        shared_expert_intermediate_size: the talker's sigmoid-gated shared expert (None: none).
        max_positions: ``max_position_embeddings`` (checked against prompts, not a table size).
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    attention_bias: bool
    rope: RopeConfig
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    shared_expert_intermediate_size: int | None
    max_positions: int

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts (the reference's rule:
        not in ``mlp_only_layers``, experts > 0 and ``(layer + 1) % decoder_sparse_step == 0``)."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def parse(cls, section: dict[str, Any], where: str, shared_expert: bool) -> MoEDecoderConfig:
        """Raises: CheckpointConfigError on a missing or malformed field, a non-SiLU activation,
        sliding-window attention, heads that do not group, ``top_k`` outside 1..num_experts or
        a non-positive size."""

        def req(key: str, kind: Callable[[Any], Any] | None = None) -> Any:
            return _require(section, key, where, kind)

        if section.get("hidden_act", "silu") != "silu":
            raise CheckpointConfigError(
                f"{where}.hidden_act is {section['hidden_act']!r}; only 'silu' is supported"
            )
        # a sliding_window size may be present; the reference uses it only when switched on
        if section.get("use_sliding_window"):
            raise CheckpointConfigError(
                f"{where}.use_sliding_window is set; sliding-window attention is not supported"
            )
        head_dim = req("head_dim", int)
        # the talker's text config is written with num_local_experts by transformers 5
        experts_key = (
            "num_experts"
            if "num_experts" in section or "num_local_experts" not in section
            else "num_local_experts"
        )
        mlp_only = req("mlp_only_layers") if "mlp_only_layers" in section else []
        if not isinstance(mlp_only, list) or not all(isinstance(x, int) for x in mlp_only):
            raise CheckpointConfigError(
                f"{where}.mlp_only_layers = {mlp_only!r} is not a list of ints"
            )
        config = cls(
            hidden_size=req("hidden_size", int),
            intermediate_size=req("intermediate_size", int),
            num_layers=req("num_hidden_layers", int),
            num_heads=req("num_attention_heads", int),
            num_kv_heads=req("num_key_value_heads", int),
            head_dim=head_dim,
            rms_norm_eps=req("rms_norm_eps", float),
            vocab_size=req("vocab_size", int),
            attention_bias=bool(section.get("attention_bias", False)),
            rope=RopeConfig.parse(section, where, head_dim, multimodal=True),
            num_experts=req(experts_key, int),
            top_k=req("num_experts_per_tok", int),
            moe_intermediate_size=req("moe_intermediate_size", int),
            norm_topk_prob=req("norm_topk_prob", bool),
            decoder_sparse_step=_require(section, "decoder_sparse_step", where, int)
            if "decoder_sparse_step" in section
            else 1,
            mlp_only_layers=tuple(mlp_only),
            shared_expert_intermediate_size=req("shared_expert_intermediate_size", int)
            if shared_expert
            else None,
            max_positions=req("max_position_embeddings", int),
        )
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size", "num_experts", "moe_intermediate_size", "decoder_sparse_step", "max_positions"):  # fmt: skip
            _positive(getattr(config, name), f"{where}.{name}")
        _positive(config.rms_norm_eps, f"{where}.rms_norm_eps")
        if config.num_heads % config.num_kv_heads:
            raise CheckpointConfigError(
                f"{where}: {config.num_heads} heads do not group over {config.num_kv_heads} kv heads"
            )
        if not 1 <= config.top_k <= config.num_experts:
            raise CheckpointConfigError(
                f"{where}.num_experts_per_tok = {config.top_k} is not in 1..{config.num_experts}"
            )
        if config.shared_expert_intermediate_size is not None:
            _positive(
                config.shared_expert_intermediate_size, f"{where}.shared_expert_intermediate_size"
            )
        return config


@dataclass(frozen=True)
class ThinkerConfig:
    """``thinker_config``: the MoE text model, the two encoders and the ids the MRoPE
    positions depend on.

    ``spatial_merge_size`` is read from ``vision_config`` (the merged grid is what positions
    count); ``audio`` and ``vision`` are parsed by the encoders' own ``from_hf``.
    """

    text: MoEDecoderConfig
    audio: AudioEncoderConfig
    vision: VisionEncoderConfig
    audio_token_id: int
    image_token_id: int
    video_token_id: int
    audio_start_token_id: int
    vision_start_token_id: int
    position_id_per_seconds: int
    spatial_merge_size: int
    deepstack_layers: int

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> ThinkerConfig:
        where = "thinker_config"

        def req(key: str) -> int:
            return _require(raw, key, where, int)

        vision = _require(raw, "vision_config", where)
        text = MoEDecoderConfig.parse(
            _require(raw, "text_config", where), f"{where}.text_config", shared_expert=False
        )
        deepstack = _require(vision, "deepstack_visual_indexes", f"{where}.vision_config")
        if not isinstance(deepstack, list):
            raise CheckpointConfigError(
                f"{where}.vision_config.deepstack_visual_indexes is not a list"
            )
        if len(deepstack) > text.num_layers:
            raise CheckpointConfigError(
                f"{where}: {len(deepstack)} deepstack levels for {text.num_layers} decoder layers"
            )
        encoders = {}
        for key, parse in (
            ("audio_config", AudioEncoderConfig.from_hf),
            ("vision_config", VisionEncoderConfig.from_hf),
        ):
            try:
                encoders[key] = parse(_require(raw, key, where))
            except CheckpointConfigError:
                raise
            except (ValueError, TypeError) as exc:
                raise CheckpointConfigError(f"{where}.{key}: {exc}") from None
        for key, width in (("audio_config", encoders["audio_config"].output_dim),
                           ("vision_config", encoders["vision_config"].out_hidden_size)):  # fmt: skip
            if width != text.hidden_size:
                raise CheckpointConfigError(
                    f"{where}.{key}: output width {width} != the text model's hidden size {text.hidden_size}"
                )
        config = cls(
            text=text,
            audio=encoders["audio_config"],
            vision=encoders["vision_config"],
            audio_token_id=req("audio_token_id"),
            image_token_id=req("image_token_id"),
            video_token_id=req("video_token_id"),
            audio_start_token_id=req("audio_start_token_id"),
            vision_start_token_id=req("vision_start_token_id"),
            position_id_per_seconds=req("position_id_per_seconds"),
            spatial_merge_size=_require(
                vision, "spatial_merge_size", f"{where}.vision_config", int
            ),
            deepstack_layers=len(deepstack),
        )
        _positive(config.spatial_merge_size, f"{where}.vision_config.spatial_merge_size")
        _positive(config.position_id_per_seconds, f"{where}.position_id_per_seconds")
        return config


@dataclass(frozen=True)
class TalkerConfig:
    """``talker_config``: the MoE talker (gated shared expert), its projections of thinker rows,
    the code predictor and the codec ids.

    Attributes:
        projection_size: inner width of ``text_projection`` / ``hidden_projection``
            (``text_config.intermediate_size``: thinker hidden -> this -> talker hidden).
        accept_hidden_layer: which thinker hidden state feeds multimodal rows: index into the
            reference's ``hidden_states`` tuple (0 = embeddings, k = output of decoder layer k-1).
        speaker_id: speaker name (lower case) -> codec id.
    """

    text: MoEDecoderConfig
    code_predictor: CodePredictorConfig
    thinker_hidden_size: int
    projection_size: int
    accept_hidden_layer: int
    num_code_groups: int
    codec_eos_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    codec_pad_id: int
    codec_bos_id: int
    speaker_id: dict[str, int]

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> TalkerConfig:
        where = "talker_config"

        def req(key: str) -> int:
            return _require(raw, key, where, int)

        text = MoEDecoderConfig.parse(
            _require(raw, "text_config", where), f"{where}.text_config", shared_expert=True
        )
        if text.mlp_only_layers or text.decoder_sparse_step != 1:
            # the reference builds every talker layer as a shared-expert MoE whatever these say
            raise CheckpointConfigError(
                f"{where}.text_config: mlp_only_layers / decoder_sparse_step must leave every layer MoE"
            )
        speakers = _require(raw, "speaker_id", where)
        if not isinstance(speakers, dict) or not speakers:
            raise CheckpointConfigError(
                f"{where}.speaker_id must be a non-empty object name -> codec id"
            )
        speaker_id = {}
        for name, value in speakers.items():
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value < text.vocab_size
            ):
                raise CheckpointConfigError(
                    f"{where}.speaker_id.{name} = {value!r} is not a codec id < {text.vocab_size}"
                )
            speaker_id[name.lower()] = value
        predictor = _parse_code_predictor(
            _require(raw, "code_predictor_config", where), f"{where}.code_predictor_config"
        )
        config = cls(
            text=text,
            code_predictor=predictor,
            thinker_hidden_size=req("thinker_hidden_size"),
            projection_size=text.intermediate_size,
            accept_hidden_layer=req("accept_hidden_layer"),
            num_code_groups=req("num_code_groups"),
            codec_eos_id=req("codec_eos_token_id"),
            codec_nothink_id=req("codec_nothink_id"),
            codec_think_bos_id=req("codec_think_bos_id"),
            codec_think_eos_id=req("codec_think_eos_id"),
            codec_pad_id=req("codec_pad_id"),
            codec_bos_id=req("codec_bos_id"),
            speaker_id=speaker_id,
        )
        for key in (
            "codec_eos_id",
            "codec_nothink_id",
            "codec_think_bos_id",
            "codec_think_eos_id",
            "codec_pad_id",
            "codec_bos_id",
        ):
            value = getattr(config, key)
            if not 0 <= value < text.vocab_size:
                raise CheckpointConfigError(
                    f"{where}.{key} = {value} is not below the codec vocabulary {text.vocab_size}"
                )
        if predictor.num_code_groups != config.num_code_groups:
            raise CheckpointConfigError(
                f"{where}.num_code_groups = {config.num_code_groups} but the code predictor has {predictor.num_code_groups}"
            )
        if config.num_code_groups < 2:
            raise CheckpointConfigError(
                f"{where}.num_code_groups = {config.num_code_groups} must be >= 2"
            )
        if predictor.decoder.hidden_size != text.hidden_size:
            raise CheckpointConfigError(
                f"{where}: code predictor hidden {predictor.decoder.hidden_size} != talker hidden {text.hidden_size}"
            )
        return config


def _parse_code_predictor(raw: dict[str, Any], where: str) -> CodePredictorConfig:
    """The dense 1-D-RoPE code predictor, as the Qwen3-TTS predictor type (same modules)."""

    def req(key: str, kind: Callable[[Any], Any]) -> Any:
        return _require(raw, key, where, kind)

    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointConfigError(
            f"{where}.hidden_act is {raw['hidden_act']!r}; only 'silu' is supported"
        )
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ()):
        raise CheckpointConfigError(f"{where}: sliding-window attention is not supported")
    head_dim = req("head_dim", int)
    decoder = DecoderConfig(
        hidden_size=req("hidden_size", int),
        intermediate_size=req("intermediate_size", int),
        num_layers=req("num_hidden_layers", int),
        num_heads=req("num_attention_heads", int),
        num_kv_heads=req("num_key_value_heads", int),
        head_dim=head_dim,
        rms_norm_eps=req("rms_norm_eps", float),
        rope_theta=RopeConfig.parse(raw, where, head_dim, multimodal=False).theta,
        vocab_size=req("vocab_size", int),
        attention_bias=bool(raw.get("attention_bias", False)),
    )
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
    ):
        _positive(getattr(decoder, name), f"{where}.{name}")
    if decoder.num_heads % decoder.num_kv_heads:
        raise CheckpointConfigError(
            f"{where}: {decoder.num_heads} heads do not group over {decoder.num_kv_heads} kv heads"
        )
    return CodePredictorConfig(decoder=decoder, num_code_groups=req("num_code_groups", int))


@dataclass(frozen=True)
class Qwen3OmniConfig:
    """The whole ``config.json`` (the parts the thinker, talker and prompts read).

    ``talker`` is None when ``enable_audio_output`` is false (a thinker-only checkpoint).
    ``talker`` and ``code2wav`` are None when ``enable_audio_output`` is false (a
    thinker-only checkpoint). The raw ``thinker_config.audio_config``,
    ``thinker_config.vision_config`` and ``code2wav_config`` sections are parsed by the
    encoder and code2wav modules' ``from_hf``.
    """

    thinker: ThinkerConfig
    talker: TalkerConfig | None
    code2wav: Code2WavConfig | None
    im_start_id: int
    im_end_id: int
    system_id: int
    user_id: int
    assistant_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Qwen3OmniConfig:
        """Raises: CheckpointConfigError naming the field: missing or malformed, ``architectures``
        lacking :data:`ARCHITECTURE`, a token id outside the thinker vocabulary, the talker's
        ``thinker_hidden_size`` differing from the thinker's hidden size, or
        ``accept_hidden_layer`` outside 0..thinker layers."""

        def req(key: str) -> int:
            return _require(raw, key, "", int)

        architectures = _require(raw, "architectures", "")
        if not isinstance(architectures, list) or ARCHITECTURE not in architectures:
            raise CheckpointConfigError(f"architectures {architectures!r} lack {ARCHITECTURE!r}")
        thinker = ThinkerConfig.parse(_require(raw, "thinker_config", ""))
        audio_output = (
            _require(raw, "enable_audio_output", "", bool) if "enable_audio_output" in raw else True
        )
        talker = TalkerConfig.parse(_require(raw, "talker_config", "")) if audio_output else None
        code2wav = None
        if audio_output:
            try:
                code2wav = Code2WavConfig.from_hf(_require(raw, "code2wav_config", ""))
            except CheckpointConfigError:
                raise
            except (ValueError, TypeError) as exc:
                raise CheckpointConfigError(f"code2wav_config: {exc}") from None
        config = cls(
            thinker=thinker,
            talker=talker,
            code2wav=code2wav,
            im_start_id=req("im_start_token_id"),
            im_end_id=req("im_end_token_id"),
            system_id=req("system_token_id"),
            user_id=req("user_token_id"),
            assistant_id=req("assistant_token_id"),
            tts_pad_id=req("tts_pad_token_id"),
            tts_bos_id=req("tts_bos_token_id"),
            tts_eos_id=req("tts_eos_token_id"),
        )
        vocab = thinker.text.vocab_size
        ids = {
            "im_start_token_id": config.im_start_id, "im_end_token_id": config.im_end_id,
            "system_token_id": config.system_id, "user_token_id": config.user_id,
            "assistant_token_id": config.assistant_id, "tts_pad_token_id": config.tts_pad_id,
            "tts_bos_token_id": config.tts_bos_id, "tts_eos_token_id": config.tts_eos_id,
            "thinker_config.audio_token_id": thinker.audio_token_id, "thinker_config.image_token_id": thinker.image_token_id,
            "thinker_config.video_token_id": thinker.video_token_id,
            "thinker_config.audio_start_token_id": thinker.audio_start_token_id,
            "thinker_config.vision_start_token_id": thinker.vision_start_token_id,
        }  # fmt: skip
        for field, value in ids.items():
            if not 0 <= value < vocab:
                raise CheckpointConfigError(
                    f"{field} = {value} is not below the thinker vocabulary {vocab}"
                )
        if talker is not None:
            if talker.thinker_hidden_size != thinker.text.hidden_size:
                raise CheckpointConfigError(
                    f"talker_config.thinker_hidden_size = {talker.thinker_hidden_size} but the thinker's hidden size is "
                    f"{thinker.text.hidden_size}"
                )
            if not 0 <= talker.accept_hidden_layer <= thinker.text.num_layers:
                raise CheckpointConfigError(
                    f"talker_config.accept_hidden_layer = {talker.accept_hidden_layer} is not in 0..{thinker.text.num_layers}"
                )
        return config


def read_config_json(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The raw ``<checkpoint_dir>/config.json`` object (the encoders parse their sections).

    Raises: CheckpointConfigError when the file is missing, unreadable or not an object."""
    return read_json_object(Path(checkpoint_dir) / CONFIG_FILE)


def load_config(checkpoint_dir: str | Path) -> Qwen3OmniConfig:
    """Parse ``<checkpoint_dir>/config.json``.

    Raises: CheckpointConfigError (a ValueError) naming the file and the field;
    :meth:`Qwen3OmniConfig.from_dict` lists the checks."""
    return load_json(Path(checkpoint_dir) / CONFIG_FILE, Qwen3OmniConfig.from_dict)
