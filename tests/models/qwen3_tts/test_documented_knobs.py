"""Every Qwen3-TTS knob docs/qwen3_tts.md lists is settable from the command line and
from a YAML override file, and listed by ``config resolve`` (the factories' signatures are the knob schema). A Base
checkpoint has every stage (its reference encoder included)."""

from __future__ import annotations

import inspect
import re
import typing
from pathlib import Path

import pytest
import yaml

from omnistage.config.hooks import factory_parameters
from omnistage.config.overrides import resolve_config
from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.models.qwen3_tts.stages import (
    PREFILL_GRAPH_TOKENS,
    _prefill_buckets,
    create_tts_engine_stage,
)

DOC = Path(__file__).parents[3] / "docs" / "qwen3_tts.md"


def documented_knobs() -> list[str]:
    """``<stage>.factory.args.<name>`` for each name in the doc's "Knobs" list."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("Knobs (`--<stage>.factory.args.<name> VALUE`") :]
    section = section[: section.index("- every stage:")]
    knobs = []
    for bullet in re.findall(r"^- (.+?)(?=^- |\Z)", section, flags=re.M | re.S):
        for part in bullet.split(";"):  # "`stage`: `a`, `b`; `other` (note): `c`"
            m = re.match(r"\s*`(\w+)`(?:\s*\([^)]*\))?:(.*)", part, flags=re.S)
            if m:
                knobs += [f"{m[1]}.factory.args.{name}" for name in re.findall(r"`(\w+)`", m[2])]
    return knobs


def test_the_doc_lists_every_knob_the_factories_take(tiny_checkpoints):
    defaults = Qwen3TTSPipelineConfig.for_model_path(str(tiny_checkpoints["base"]))
    taken = {
        f"{stage.name}.factory.args.{name}" for stage in defaults.stages for name in factory_parameters(stage)
    }
    assert set(documented_knobs()) == taken


def changed(value, annotation):
    """A value of the same kind as the default ``value`` but different (None: a bool if
    the parameter's ``annotation`` takes one, a one-item list if it takes a tuple, else an
    int)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 if value else 1
    if isinstance(value, list):
        return value[:-1]
    assert value is None
    options = typing.get_args(annotation)
    if bool in options:
        return True
    return [16] if any(typing.get_origin(option) is tuple for option in options) else 1 << 20


@pytest.mark.parametrize("source", ["cli", "yaml"])
@pytest.mark.parametrize("path", documented_knobs())
def test_a_documented_knob_is_listed_and_settable(tiny_checkpoints, tmp_path, path, source):
    defaults = Qwen3TTSPipelineConfig.for_model_path(str(tiny_checkpoints["base"]))
    listed = resolve_config(defaults, None, [])
    assert listed.provenance[path] == "default"
    current = dict(line.split(" = ", 1) for line in listed.provenance_text().splitlines())[path]
    stage, _, _, name = path.split(".")
    annotation = factory_parameters(defaults.stage(stage))[name].annotation
    new = changed(yaml.safe_load(current.split("  # ")[0]), annotation)
    if source == "cli":
        resolved = resolve_config(defaults, None, [(path, yaml.safe_dump(new, default_flow_style=True).strip())])
    else:
        overrides = tmp_path / "overrides.yaml"
        overrides.write_text(yaml.safe_dump({"stages": {stage: {"factory": {"args": {name: new}}}}}))
        resolved = resolve_config(defaults, overrides, [])
        source = f"yaml:{overrides}"
    assert resolved.provenance[path] == source
    got = resolved.config.stage(stage).factory.args[name]
    assert (list(got) if isinstance(got, tuple) else got) == new


def test_the_tts_engines_prefill_buckets_default_to_graphs_up_to_its_prefill_budget():
    assert _prefill_buckets(None, 1024) == PREFILL_GRAPH_TOKENS == (16, 32, 64, 128, 256, 512, 1024)
    assert _prefill_buckets(None, 300) == (16, 32, 64, 128, 256)
    assert _prefill_buckets((), 1024) == ()
    assert _prefill_buckets((48,), 1024) == (48,)
    assert inspect.signature(create_tts_engine_stage).parameters["max_prefill_tokens"].default == 1024
