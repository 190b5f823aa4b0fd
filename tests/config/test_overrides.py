"""Layered config resolution: model defaults < YAML file < CLI, with provenance."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omnistage.config.overrides import (
    ConfigOverrideError,
    parse_cli_overrides,
    resolve_config,
)
from omnistage.config.pipeline import FactoryConfig, PipelineConfig, StageConfig


class EngineArgs(BaseModel):
    """A typed sub-model of a stage (like an LLM engine's arguments)."""

    model_config = ConfigDict(extra="forbid")
    max_running_requests: int = Field(default=16, ge=1, le=1024)
    kv_cache_dtype: str = "auto"


class EngineStage(StageConfig):
    engine: EngineArgs = Field(default_factory=EngineArgs)

    @model_validator(mode="after")
    def _fp8_caps_requests(self) -> EngineStage:
        if self.engine.kv_cache_dtype == "fp8" and self.engine.max_running_requests > 64:
            raise ValueError("an fp8 KV cache runs at most 64 requests")
        return self


def make_talker(ctx, max_batch_size: int = 1, prefill_hold_ms: float = 5.0):
    """The talker's factory: its parameters are the stage's knobs (never built here)."""
    raise AssertionError("resolving a config never builds a stage")


def make_vocoder(
    ctx,
    chunk_ms: float = 20.0,
    warmup: bool = False,
    sampling: dict | None = None,
    ramp: tuple[int, ...] = (1, 2, 4),
    kv_cache_bytes: int | None = None,
):
    raise AssertionError("resolving a config never builds a stage")


TALKER = f"{__name__}:make_talker"
VOCODER = f"{__name__}:make_vocoder"


class TtsPipeline(PipelineConfig):
    voice_dir: str | None = None


def make_defaults() -> TtsPipeline:
    return TtsPipeline(
        name="tts",
        stages=[
            EngineStage(
                name="talker",
                factory=FactoryConfig(path=TALKER, args={"max_batch_size": 8}),
                next=["vocoder"],
                engine=EngineArgs(max_running_requests=32),
            ),
            StageConfig(
                name="vocoder",
                factory=FactoryConfig(
                    path=VOCODER,
                    args={"chunk_ms": 80.0, "warmup": True, "sampling": {"top_k": 50}},
                ),
                terminal=True,
            ),
        ],
    )


def cli(*tokens: str) -> list[tuple[str, str]]:
    return parse_cli_overrides(list(tokens))


def write_yaml(tmp_path: Path, data, name: str = "override.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


# ----------------------------------------------------------------------------- setting values


def test_dotted_overrides_set_nested_values():
    resolved = resolve_config(
        make_defaults(),
        None,
        cli(
            "--talker.engine.max_running_requests", "4",
            "--talker.factory.args.max_batch_size=2",
            "--vocoder.factory.args.sampling.top_k", "5",
            "--vocoder.device", "cuda:1",
            "--max_concurrent_requests", "8",
            "--voice_dir", "/voices",
        ),
    )  # fmt: skip
    config = resolved.config
    assert type(config) is TtsPipeline
    talker, vocoder = config.stages
    assert type(talker) is EngineStage
    assert talker.engine == EngineArgs(max_running_requests=4)
    assert talker.factory.args == {"max_batch_size": 2, "prefill_hold_ms": 5.0}
    assert vocoder.factory.args == {
        "chunk_ms": 80.0, "warmup": True, "sampling": {"top_k": 5}, "ramp": (1, 2, 4), "kv_cache_bytes": None,
    }  # fmt: skip
    assert vocoder.device == "cuda:1"
    assert config.max_concurrent_requests == 8
    assert config.voice_dir == "/voices"
    # untouched values and topology survive
    assert talker.next == ["vocoder"] and vocoder.terminal
    assert talker.factory.path == TALKER


@pytest.mark.parametrize(
    ("path", "text", "expected"),
    [
        ("vocoder.factory.args.warmup", "false", False),
        ("vocoder.factory.args.chunk_ms", "40", 40.0),  # int text widened to the float knob
        ("vocoder.factory.args.chunk_ms", "0.5", 0.5),
        ("request_timeout_s", "null", None),
        ("talker.factory.args.prefill_hold_ms", "0", 0.0),  # a knob the model leaves at its default
        ("vocoder.factory.args.ramp", "[2, 4]", (2, 4)),  # typed by the factory's annotation
        ("vocoder.factory.args.kv_cache_bytes", "1024", 1024),
        ("vocoder.device", "16", "16"),  # a str field keeps the raw text
        ("vocoder.device", "true", "true"),
        ("vocoder.factory.args.kv_cache_bytes", "null", None),
    ],
)
def test_cli_values_are_parsed_as_yaml_then_validated(path, text, expected):
    resolved = resolve_config(make_defaults(), None, [(path, text)])
    assert path in resolved.provenance and resolved.provenance[path] == "cli"
    got = _get_path(resolved.config, path)
    assert got == expected and type(got) is type(expected)


def _get_path(config: PipelineConfig, path: str):
    head, _, rest = path.partition(".")
    names = [s.name for s in config.stages]
    obj = config.stage(head) if head in names else getattr(config, head)
    for seg in rest.split(".") if head in names else []:
        obj = obj[seg] if isinstance(obj, dict) else getattr(obj, seg)
    return obj


def test_knob_type_comes_from_its_default():
    with pytest.raises(ConfigOverrideError, match=r"talker\.factory\.args\.max_batch_size"):
        resolve_config(make_defaults(), None, cli("--talker.factory.args.max_batch_size", "2.5"))
    with pytest.raises(ConfigOverrideError, match=r"vocoder\.factory\.args\.warmup"):
        resolve_config(make_defaults(), None, cli("--vocoder.factory.args.warmup", "1"))


# ----------------------------------------------------------------------------- layers


def test_yaml_then_cli_precedence(tmp_path):
    override = write_yaml(
        tmp_path,
        {
            "max_concurrent_requests": 8,
            "stages": {
                "talker": {"engine": {"max_running_requests": 4}, "device": "cuda:0"},
                "vocoder": {"factory": {"args": {"chunk_ms": 40.0}}},
            },
        },
    )
    resolved = resolve_config(
        make_defaults(),
        override,
        cli("--talker.engine.max_running_requests", "2", "--vocoder.device", "cuda:1"),
    )
    talker, vocoder = resolved.config.stages
    assert resolved.config.max_concurrent_requests == 8
    assert talker.engine.max_running_requests == 2  # CLI beats YAML
    assert talker.device == "cuda:0"
    assert vocoder.factory.args["chunk_ms"] == 40.0
    assert vocoder.device == "cuda:1"
    src = f"yaml:{override}"
    prov = resolved.provenance
    assert prov["max_concurrent_requests"] == src
    assert prov["talker.engine.max_running_requests"] == "cli"
    assert prov["talker.device"] == src
    assert prov["vocoder.factory.args.chunk_ms"] == src
    assert prov["vocoder.device"] == "cli"
    assert prov["talker.factory.args.max_batch_size"] == "default"
    assert prov["voice_dir"] == "default"
    assert not any(p.endswith((".name", ".next", ".factory.path", ".terminal")) for p in prov)


def test_same_precedence_conflict_names_both_values(tmp_path):
    with pytest.raises(ConfigOverrideError) as err:
        resolve_config(
            make_defaults(),
            None,
            cli("--max_concurrent_requests", "8", "--max_concurrent_requests=9"),
        )
    message = str(err.value)
    assert "max_concurrent_requests" in message and "8" in message and "9" in message
    assert err.value.source == "cli"
    # the same value twice is fine, also when spelled differently
    same = resolve_config(
        make_defaults(), None, cli("--vocoder.factory.args.chunk_ms", "40", "--vocoder.factory.args.chunk_ms=40.0")
    )  # fmt: skip
    assert same.config.stages[1].factory.args["chunk_ms"] == 40.0


def test_yaml_duplicate_key_with_different_values_is_a_conflict(tmp_path):
    override = write_yaml(tmp_path, "max_concurrent_requests: 8\nmax_concurrent_requests: 9\n")
    with pytest.raises(ConfigOverrideError, match=r"max_concurrent_requests.*8.*9"):
        resolve_config(make_defaults(), override, [])
    dotted_and_nested = write_yaml(
        tmp_path,
        {"talker.device": "cuda:0", "stages": {"talker": {"device": "cuda:1"}}},
        name="both.yaml",
    )
    with pytest.raises(ConfigOverrideError, match=r"talker\.device.*two different") as err:
        resolve_config(make_defaults(), dotted_and_nested, [])
    assert "cuda:0" in str(err.value) and "cuda:1" in str(err.value)


# ----------------------------------------------------------------------------- refusals


def test_unknown_path_suggests_the_right_one(tmp_path):
    with pytest.raises(ConfigOverrideError) as err:
        resolve_config(make_defaults(), None, cli("--talker.engine.max_runing_requests", "4"))
    assert "did you mean 'talker.engine.max_running_requests'" in str(err.value)
    assert err.value.path == "talker.engine.max_runing_requests"
    override = write_yaml(tmp_path, {"stages": {"vocodr": {"factory": {"args": {"chunk_ms": 1}}}}})
    with pytest.raises(ConfigOverrideError) as err:
        resolve_config(make_defaults(), override, [])
    assert "did you mean 'vocoder.factory.args.chunk_ms'" in str(err.value)
    assert err.value.source == f"yaml:{override}"


def test_a_knob_of_another_stage_is_named_with_its_stage_not_suggested():
    with pytest.raises(ConfigOverrideError) as err:
        resolve_config(make_defaults(), None, cli("--vocoder.factory.args.max_batch_size", "2"))
    message = str(err.value)
    assert "'factory.args.max_batch_size' is set on stage 'talker'" in message
    assert "did you mean 'talker" not in message
    with pytest.raises(ConfigOverrideError) as err:
        resolve_config(make_defaults(), None, cli("--vocoder.factory.args.chunk_m", "2"))
    assert "did you mean 'vocoder.factory.args.chunk_ms'?" in str(err.value)


def test_model_args_the_factory_does_not_take_are_refused():
    defaults = make_defaults()
    defaults.stages[0].factory.args["max_batch"] = 2
    with pytest.raises(ConfigOverrideError, match=r"\['max_batch'\] are not parameters.*max_batch_size"):
        resolve_config(defaults, None, [])
    defaults.stages[0].factory.path = "no_such_module:make"
    with pytest.raises(ConfigOverrideError, match="cannot import 'no_such_module'"):
        resolve_config(defaults, None, [])


def test_placement_fields_and_custom_resources_are_settable(tmp_path):
    placement = ("--placement", "ray", "--ray_address", "10.0.0.1:6379", "--vocoder.process", "codec",
                 "--vocoder.replicas", "2", "--vocoder.resources.custom", "{worker: 1}")  # fmt: skip
    config = resolve_config(make_defaults(), None, cli(*placement)).config
    assert (config.placement, config.ray_address) == ("ray", "10.0.0.1:6379")
    vocoder = config.stage("vocoder")
    assert (vocoder.process, vocoder.replicas, vocoder.resources.custom) == ("codec", 2, {"worker": 1.0})
    file = tmp_path / "ray.yaml"
    file.write_text("stages:\n  talker:\n    resources: {cpus: 2, custom: {head: 0.5}}\n")
    resources = resolve_config(make_defaults(), file, []).config.stage("talker").resources
    assert (resources.cpus, resources.custom) == (2.0, {"head": 0.5})
    with pytest.raises(ConfigOverrideError, match="vocoder.resources.custom"):
        resolve_config(make_defaults(), None, cli("--vocoder.resources.custom", "{worker: many}"))


def test_undeclared_dict_knob_is_unknown():
    with pytest.raises(ConfigOverrideError, match="unknown config path"):
        resolve_config(make_defaults(), None, cli("--talker.factory.args.new_knob", "1"))


def test_group_path_lists_its_fields():
    with pytest.raises(ConfigOverrideError, match=r"group.*talker\.engine\.kv_cache_dtype"):
        resolve_config(make_defaults(), None, cli("--talker.engine", "4"))


@pytest.mark.parametrize(
    "path",
    [
        "talker.name",
        "talker.factory.path",
        "talker.next",
        "vocoder.terminal",
        "talker.route_fn",
        "vocoder.wait_for",
        "vocoder.merge_fn",
        "talker.stream_to",
        "talker.can_accept_stream_before_payload",
        "stages",
        "entry_stage",
        "terminal_stages_fn",
        "sample_requests_fn",
    ],
)
def test_topology_is_refused(path):
    with pytest.raises(ConfigOverrideError, match="topology") as err:
        resolve_config(make_defaults(), None, [(path, "x")])
    assert path in str(err.value)


def test_topology_is_refused_from_yaml(tmp_path):
    override = write_yaml(tmp_path, {"stages": {"talker": {"next": ["talker"]}}})
    with pytest.raises(ConfigOverrideError, match=r"'talker\.next'.*yaml:.*topology"):
        resolve_config(make_defaults(), override, [])


@pytest.mark.parametrize(
    ("tokens", "path"),
    [
        (["--max_concurrent_requests", "0"], "max_concurrent_requests"),
        (["--talker.engine.max_running_requests", "5000"], "talker.engine.max_running_requests"),
        (["--vocoder.factory.args.kv_cache_bytes", "1.5"], "vocoder.factory.args.kv_cache_bytes"),
        (["--vocoder.factory.args.ramp", "[a]"], "vocoder.factory.args.ramp"),
        (["--request_timeout_s", "fast"], "request_timeout_s"),
    ],
)
def test_constraint_violation_names_the_path(tokens, path):
    with pytest.raises(ConfigOverrideError) as err:
        resolve_config(make_defaults(), None, cli(*tokens))
    assert repr(path) in str(err.value) and "(from cli)" in str(err.value)
    assert err.value.path == path


def test_cross_field_validation_of_the_resolved_model_names_the_overrides():
    tokens = ("--talker.engine.kv_cache_dtype", "fp8", "--talker.engine.max_running_requests", "100")
    with pytest.raises(ConfigOverrideError) as err:
        resolve_config(make_defaults(), None, cli(*tokens))
    message = str(err.value)
    assert "at most 64 requests" in message
    assert "talker.engine.kv_cache_dtype (from cli)" in message
    assert "talker.engine.max_running_requests (from cli)" in message


def test_malformed_yaml_files_are_refused(tmp_path):
    for name, text in [("list.yaml", "- 1\n- 2\n"), ("stages.yaml", "stages:\n- name: x\n")]:
        with pytest.raises(ConfigOverrideError, match="must be a mapping"):
            resolve_config(make_defaults(), write_yaml(tmp_path, text, name), [])
    with pytest.raises(ConfigOverrideError, match="cannot load"):
        resolve_config(make_defaults(), tmp_path / "missing.yaml", [])


def test_parse_cli_overrides_forms_and_errors():
    assert parse_cli_overrides(["--a.b", "1", "--c=x=y", "--d", "-3", "--e="]) == [
        ("a.b", "1"),
        ("c", "x=y"),
        ("d", "-3"),
        ("e", ""),
    ]
    for tokens in (["--a.b"], ["--a.b", "--c", "1"], ["a.b", "1"], ["--", "1"], ["--=1"]):
        with pytest.raises(ConfigOverrideError):
            parse_cli_overrides(tokens)


# ----------------------------------------------------------------------------- result


def test_defaults_are_not_modified():
    defaults = make_defaults()
    before = defaults.model_dump(serialize_as_any=True)
    resolved = resolve_config(
        defaults,
        None,
        cli("--talker.engine.max_running_requests", "4", "--vocoder.factory.args.sampling.top_k", "1"),
    )  # fmt: skip
    assert defaults.model_dump(serialize_as_any=True) == before
    resolved.config.stages[1].factory.args["warmup"] = False  # the result owns its data
    resolved.config.stages[0].factory.args["max_batch_size"] = 99
    assert defaults.model_dump(serialize_as_any=True) == before


def test_text_renderings(tmp_path):
    override = write_yaml(
        tmp_path, {"stages": {"vocoder": {"factory": {"args": {"chunk_ms": 40}}}}}
    )
    resolved = resolve_config(
        make_defaults(),
        override,
        cli("--talker.engine.max_running_requests", "4", "--max_concurrent_requests", "64"),
    )
    src = f"yaml:{override}"

    dumped = yaml.safe_load(resolved.to_yaml())
    assert [s["name"] for s in dumped["stages"]] == ["talker", "vocoder"]
    assert dumped["stages"][0]["engine"] == {"max_running_requests": 4, "kv_cache_dtype": "auto"}
    assert dumped["stages"][1]["factory"] == resolved.config.stages[1].factory.model_dump(mode="json")
    assert dumped["max_concurrent_requests"] == 64

    diff = resolved.diff_yaml()
    assert "      max_running_requests: 4  # 32 -> 4 (cli)\n" in diff
    assert f"        chunk_ms: 40.0  # 80.0 -> 40.0 ({src})\n" in diff
    assert "max_concurrent_requests" not in diff  # set, but equal to the default
    assert "kv_cache_dtype" not in diff
    # the diff is itself an override file reproducing the resolved config
    diff_file = write_yaml(tmp_path, diff, name="diff.yaml")
    assert resolve_config(make_defaults(), diff_file, []).config == resolved.config

    lines = resolved.provenance_text().splitlines()
    assert "talker.engine.max_running_requests = 4  # cli" in lines
    assert f"vocoder.factory.args.chunk_ms = 40.0  # {src}" in lines
    assert "max_concurrent_requests = 64  # cli" in lines
    assert "vocoder.factory.args.sampling.top_k = 50  # default" in lines
    assert "vocoder.factory.args.kv_cache_bytes = null  # default" in lines
    assert "talker.factory.args.prefill_hold_ms = 5.0  # default" in lines
    assert len(lines) == len(resolved.provenance)


def test_no_overrides_reproduces_defaults_with_every_factory_knob():
    defaults = make_defaults()
    resolved = resolve_config(defaults, None, [])
    assert resolved.config == resolved.defaults and resolved.config is not defaults
    assert resolved.config.stages[0].factory.args == {"max_batch_size": 8, "prefill_hold_ms": 5.0}
    assert defaults.stages[0].factory.args == {"max_batch_size": 8}  # the caller's copy
    assert set(resolved.provenance.values()) == {"default"}
    assert resolved.diff_yaml().startswith("{}")


@pytest.mark.parametrize("path", ["name", "model_path"])
def test_model_identity_is_not_overridable(path):
    with pytest.raises(ConfigOverrideError, match="cannot be overridden"):
        resolve_config(make_defaults(), None, [(path, "other")])
