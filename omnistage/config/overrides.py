"""Resolve a pipeline config from three layers: model defaults < YAML file < CLI flags.

Every settable value has a dotted *path*:

- ``<field>`` for a top-level :class:`PipelineConfig` field (``max_concurrent_requests``);
- ``<stage>.<field>[.<field>...]`` for a stage field, addressing the stage by its name and
  walking typed sub-models (``tts.device``, ``tts.engine.max_running_requests`` for a
  :class:`StageConfig` subclass with an ``engine`` sub-model);
- ``<stage>.factory.args.<name>`` for a scheduler knob: the keyword parameters of the
  stage's factory are its knob schema (the annotation types the value; the model's
  ``args``, else the parameter's default, is the default), so resolving imports each
  factory's module. A knob whose default is a non-empty dict is a group of knobs typed by
  their defaults (``args.sampling.top_k``). The resolved config holds every knob.
- a dict field whose default is empty (``<stage>.resources.custom``) is one value, the
  whole mapping (``--vocoder.resources.custom '{worker: 1}'``).

Topology (stage ``name``, ``factory.path``, ``next``, ``terminal``, the hooks, the stream
edges, and the top-level ``stages``, ``entry_stage``, ``terminal_stages_fn``,
``sample_requests_fn``) is part of the model, not a user setting, and is refused.

YAML override file: a mapping with top-level fields as keys plus ``stages:``, a mapping
from stage name to nested fields::

    max_concurrent_requests: 8
    stages:
      tts:
        factory: {args: {max_batch_size: 4}}

CLI overrides are ``--<path> VALUE`` or ``--<path>=VALUE``; the value text is parsed like a
YAML scalar (``16`` -> 16, ``true`` -> True, ``null`` -> None, ``[1, 2]`` -> list). If the
parsed value is rejected by a ``str`` field, the raw text is used instead (``--x.name 16``).

Every value is validated against its field's type and constraints, then the whole config is
re-validated (cross-field checks). All failures raise :class:`ConfigOverrideError` naming
the path and where the value came from (``cli`` or ``yaml:<file>``).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Strict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from omnistage.config.hooks import factory_parameters
from omnistage.config.pipeline import PipelineConfig
from omnistage.core.errors import PipelineConfigError

__all__ = [
    "ConfigOverrideError",
    "ResolvedConfig",
    "parse_cli_overrides",
    "resolve_config",
]

STAGE_TOPOLOGY = frozenset(
    {
        "name",
        "factory.path",
        "next",
        "terminal",
        "route_fn",
        "wait_for",
        "wait_for_fn",
        "merge_fn",
        "stream_to",
        "stream_done_to_fn",
        "can_accept_stream_before_payload",
        "accepts_client_input",
    }
)
# `name` and `model_path` identify what the model class built; changing them would leave
# the config out of step with its model (pass --model-path instead).
PIPELINE_TOPOLOGY = frozenset(
    {"stages", "entry_stage", "terminal_stages_fn", "sample_requests_fn", "name", "model_path"}
)
DEFAULT_SOURCE = "default"
CLI_SOURCE = "cli"


class ConfigOverrideError(ValueError):
    """A config override is invalid.

    Attributes:
        path: the dotted path concerned, when there is one.
        source: where the value came from: ``"cli"`` or ``"yaml:<file>"``.
    """

    def __init__(self, message: str, *, path: str | None = None, source: str | None = None):
        self.path = path
        self.source = source
        super().__init__(message)


@dataclass(frozen=True)
class _Leaf:
    """A settable value: ``owner`` is the stage name (None: pipeline level); ``segs`` the
    field/key path below it; ``field`` the pydantic field, or None for a dict knob whose
    type is taken from ``annotation`` (a factory parameter's), else from ``default``."""

    path: str
    owner: str | None
    segs: tuple[str, ...]
    field: FieldInfo | None
    default: Any
    annotation: Any = None

    def validate(self, value: Any) -> Any:
        """The value validated (and coerced) for this leaf; raises ValidationError."""
        if self.annotation is not None:
            # scalars keep their declared type (no 1 -> True); containers convert (a YAML
            # list -> tuple[int, ...])
            config = ConfigDict(strict=_is_scalar(self.annotation))
            return TypeAdapter(self.annotation, config=config).validate_python(value)
        return TypeAdapter(self._annotation()).validate_python(value)

    def _annotation(self) -> Any:
        if self.field is not None and self.field.metadata:
            return Annotated[self.field.annotation, *self.field.metadata]
        if self.field is not None:
            return self.field.annotation
        kind = type(self.default)
        if kind in (bool, int, float, str):
            return Annotated[kind, Strict()]  # knobs keep their declared scalar type
        if kind in (list, tuple, dict):
            return kind
        return Any


_SCALARS = (bool, int, float, str, type(None))


def _is_scalar(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return all(arg in _SCALARS for arg in typing.get_args(annotation))
    return annotation in _SCALARS


@dataclass(frozen=True)
class _Override:
    path: str
    value: Any
    source: str


# ----------------------------------------------------------------------------- leaf table


def _with_every_knob(defaults: PipelineConfig) -> tuple[PipelineConfig, dict[str, dict[str, Any]]]:
    """A copy of ``defaults`` whose stages' ``factory.args`` hold every factory parameter
    (the model's value, else the parameter's default), and each stage's knob annotations.

    Raises:
        ConfigOverrideError: a parameter without a default is missing from the args.
    """
    stages, annotations = [], {}
    for stage in defaults.stages:
        try:
            params = factory_parameters(stage)
        except PipelineConfigError as exc:
            raise ConfigOverrideError(str(exc), path=f"{stage.name}.factory") from None
        missing = [n for n, p in params.items() if n not in stage.factory.args and p.default is p.empty]
        if missing:
            raise ConfigOverrideError(
                f"stage {stage.name!r}: factory {stage.factory.path} needs {missing}, which the "
                "model's args do not give",
                path=f"{stage.name}.factory.args",
            )
        args = {n: stage.factory.args.get(n, p.default) for n, p in params.items()}
        args |= {n: v for n, v in stage.factory.args.items() if n not in args}
        factory = stage.factory.model_copy(update={"args": args})
        stages.append(stage.model_copy(update={"factory": factory}))
        annotations[stage.name] = {n: p.annotation for n, p in params.items() if p.annotation is not p.empty}
    return defaults.model_copy(update={"stages": stages}), annotations


def _leaf_table(defaults: PipelineConfig, annotations: dict[str, dict[str, Any]]) -> dict[str, _Leaf]:
    """Every settable leaf of ``defaults``, keyed by dotted path, in declaration order;
    ``annotations``: stage -> factory parameter -> its type."""
    leaves: list[_Leaf] = []
    _walk_model(defaults, None, (), PIPELINE_TOPOLOGY, leaves)
    for stage in defaults.stages:
        _walk_model(stage, stage.name, (), STAGE_TOPOLOGY, leaves)
    table: dict[str, _Leaf] = {}
    for leaf in leaves:
        if leaf.owner is not None and len(leaf.segs) == 3 and leaf.segs[:2] == ("factory", "args"):
            annotation = annotations[leaf.owner].get(leaf.segs[2])
            leaf = dataclasses.replace(leaf, annotation=annotation)
        if leaf.path in table:
            raise ConfigOverrideError(
                f"config path {leaf.path!r} is ambiguous in the model defaults (a stage "
                "name collides with a top-level field or a dict key contains a dot)",
                path=leaf.path,
            )
        table[leaf.path] = leaf
    return table


def _walk_model(model, owner, segs, topology, out) -> None:
    for name, info in type(model).model_fields.items():
        sub = (*segs, name)
        if ".".join(sub) in topology:
            continue
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            _walk_model(value, owner, sub, topology, out)
        elif isinstance(value, dict) and (value or sub == ("factory", "args")):
            _walk_dict(value, owner, sub, out)
        else:
            out.append(_Leaf(_join(owner, sub), owner, sub, info, value))


def _walk_dict(mapping, owner, segs, out) -> None:
    for key, value in mapping.items():
        if not isinstance(key, str):
            continue  # not addressable by a dotted path
        sub = (*segs, key)
        if isinstance(value, dict) and value:
            _walk_dict(value, owner, sub, out)
        else:
            out.append(_Leaf(_join(owner, sub), owner, sub, None, value))


def _join(owner: str | None, segs: tuple[str, ...]) -> str:
    return ".".join((owner, *segs) if owner is not None else segs)


def _get(config: PipelineConfig, leaf: _Leaf) -> Any:
    obj: Any = config if leaf.owner is None else config.stage(leaf.owner)
    for seg in leaf.segs:
        obj = obj[seg] if isinstance(obj, dict) else getattr(obj, seg)
    return obj


# ----------------------------------------------------------------------------- path lookup


def _lookup(path: str, source: str, table: dict[str, _Leaf], defaults: PipelineConfig) -> _Leaf:
    """The leaf at ``path``; ConfigOverrideError explaining why when it is not settable."""
    if path in table:
        return table[path]
    where = f"{path!r} (from {source})"
    if _is_topology(path, defaults):
        raise ConfigOverrideError(
            f"config path {where} is pipeline topology, fixed by the model; it cannot be "
            "overridden",
            path=path,
            source=source,
        )
    children = sorted({p[len(path) + 1 :].split(".")[0] for p in table if p.startswith(path + ".")})
    if children:
        raise ConfigOverrideError(
            f"config path {where} is a group, not a value; set one of its fields: "
            + ", ".join(f"{path}.{c}" for c in children[:12]),
            path=path,
            source=source,
        )
    head, _, rest = path.partition(".")
    stages = [s.name for s in defaults.stages]
    # a path under a stage is matched against that stage's paths only: a knob of another
    # stage is named as such, never offered as the fix
    candidates = [p for p in table if p.startswith(head + ".")] if head in stages else list(table)
    parent, _, last = path.rpartition(".")
    siblings = {p.rpartition(".")[2] for p in candidates if p.rpartition(".")[0] == parent} if parent else set()
    if siblings:  # the group exists: match the last name among its members
        close = [f"{parent}.{c}" for c in difflib.get_close_matches(last, sorted(siblings), n=3, cutoff=0.6)]
    else:
        close = difflib.get_close_matches(path, candidates, n=3, cutoff=0.6)
    elsewhere = [s for s in stages if s != head and f"{s}.{rest}" in table] if head in stages else []
    hints = ["did you mean " + " or ".join(repr(c) for c in close) + "?"] if close else []
    if elsewhere:
        hints.append(f"{rest!r} is set on stage " + " or ".join(repr(s) for s in elsewhere))
    hint = "; ".join(hints) or "stages are " + ", ".join(repr(s) for s in stages)
    raise ConfigOverrideError(f"unknown config path {where}; {hint}", path=path, source=source)


def _is_topology(path: str, defaults: PipelineConfig) -> bool:
    head, _, rest = path.partition(".")
    if head in {s.name for s in defaults.stages}:
        return any(rest == t or rest.startswith(t + ".") for t in STAGE_TOPOLOGY)
    return head in PIPELINE_TOPOLOGY


# ----------------------------------------------------------------------------- layers

_Entry = tuple[str, Any, "str | None"]  # (path, typed value, CLI text or None)


def _compile(entries: list[_Entry], source: str, table, defaults) -> dict[str, _Override]:
    """One precedence layer -> validated overrides by path; a path given twice with
    different values is an error, the same value twice is not."""
    out: dict[str, _Override] = {}
    for path, value, text in entries:
        leaf = _lookup(path, source, table, defaults)
        if text is not None:
            value = _parse_text(path, text, source)
        new = _Override(path, _validated(leaf, value, text, source), source)
        old = out.get(path)
        if old is not None and not _same(old.value, new.value):
            raise ConfigOverrideError(
                f"config path {path!r} is given two different values in {source}: "
                f"{_render(old.value)} and {_render(new.value)}",
                path=path,
                source=source,
            )
        out[path] = new
    return out


def _parse_text(path: str, text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigOverrideError(
            f"value {text!r} for config path {path!r} (from {source}) is not a valid YAML "
            f"scalar or flow value ({exc.__class__.__name__}); quote it",
            path=path,
            source=source,
        ) from None


def _validated(leaf: _Leaf, value: Any, text: str | None, source: str) -> Any:
    """``value`` validated for ``leaf``; CLI text that parsed to a non-string falls back to
    the raw text when only that is accepted (a ``str`` field given ``16``)."""
    try:
        return leaf.validate(value)
    except ValidationError as exc:
        if text is not None and not isinstance(value, str):
            try:
                return leaf.validate(text)
            except ValidationError:
                pass
        raise ConfigOverrideError(
            f"invalid value {_render(value)} for config path {leaf.path!r} (from {source}): "
            f"{exc.errors()[0]['msg']}",
            path=leaf.path,
            source=source,
        ) from None


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


# ----------------------------------------------------------------------------- apply


def _apply(defaults: PipelineConfig, overrides: dict[str, _Override], table) -> PipelineConfig:
    """A validated copy of ``defaults`` with ``overrides`` applied (defaults untouched)."""
    base = defaults.model_copy(deep=True)
    top: dict[tuple[str, ...], Any] = {}
    per_stage: dict[str, dict[tuple[str, ...], Any]] = defaultdict(dict)
    for ov in overrides.values():
        leaf = table[ov.path]
        (top if leaf.owner is None else per_stage[leaf.owner])[leaf.segs] = ov.value
    stages = [
        _rebuild(s, per_stage[s.name], s.name, overrides) if s.name in per_stage else s
        for s in base.stages
    ]
    return _rebuild(base, {**top, ("stages",): stages}, None, overrides)


def _rebuild(obj: Any, updates: dict[tuple[str, ...], Any], prefix, overrides) -> Any:
    """``obj`` (model or dict) with ``updates`` (relative segment paths) applied; a model is
    re-validated as a whole, so field constraints and model validators run."""
    groups: dict[str, dict[tuple[str, ...], Any]] = defaultdict(dict)
    for segs, value in updates.items():
        groups[segs[0]][segs[1:]] = value
    if isinstance(obj, dict):
        data = dict(obj)
    else:
        data = {name: getattr(obj, name) for name in obj.model_fields_set}
    for key, sub in groups.items():
        current = obj[key] if isinstance(obj, dict) else getattr(obj, key)
        path = key if prefix is None else f"{prefix}.{key}"
        data[key] = sub[()] if () in sub else _rebuild(current, sub, path, overrides)
    if isinstance(obj, dict):
        return data
    try:
        return type(obj).model_validate(data)
    except ValidationError as exc:
        raise _model_error(exc, prefix, data, overrides) from None


def _model_error(exc: ValidationError, prefix, data, overrides) -> ConfigOverrideError:
    err = exc.errors()[0]
    loc = [str(part) for part in err["loc"]]
    if prefix is None and loc[:1] == ["stages"] and len(loc) > 1 and loc[1].isdigit():
        loc = [data["stages"][int(loc[1])].name, *loc[2:]]
    path = ".".join(([prefix] if prefix else []) + loc)
    involved = [ov for ov in overrides.values() if _related(path, ov.path)]
    by = ", ".join(f"{ov.path} (from {ov.source})" for ov in involved) or "the model defaults"
    return ConfigOverrideError(
        f"invalid config at {path or 'pipeline'!r}: {err['msg']}; set by {by}",
        path=path or None,
        source=involved[0].source if involved else None,
    )


def _related(a: str, b: str) -> bool:
    """Whether one dotted path is the other or lies under it ('' is the root)."""
    return not a or not b or a == b or a.startswith(b + ".") or b.startswith(a + ".")


# ----------------------------------------------------------------------------- inputs


def parse_cli_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Parse ``--<path> VALUE`` and ``--<path>=VALUE`` tokens into ``(path, text)`` pairs.

    A value may not start with ``--`` in the two-token form (use ``--path=--value``).

    Raises:
        ConfigOverrideError: a token is not an option, an option has no value or no name.
    """
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        token = args[i]
        name, eq, value = token[2:].partition("=")
        if not token.startswith("--") or not name:
            raise ConfigOverrideError(
                f"expected --<path> VALUE or --<path>=VALUE, got {token!r}", source=CLI_SOURCE
            )
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigOverrideError(
                    f"option --{name} has no value; write --{name} VALUE or --{name}=VALUE",
                    path=name,
                    source=CLI_SOURCE,
                )
            value = args[i + 1]
            i += 1
        out.append((name, value))
        i += 1
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader refusing a mapping key written twice with different values (plain PyYAML
    keeps the last one silently). Merge keys (``<<``) keep their override semantics."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            value = self.construct_object(value_node, deep=True)
            try:
                clash = key in seen and not _same(seen[key], value)
            except TypeError:  # unhashable key: SafeLoader reports it below
                break
            if clash:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice with different values: "
                    f"{_render(seen[key])} and {_render(value)}",
                    key_node.start_mark,
                )
            seen[key] = value
        return super().construct_mapping(node, deep=deep)


def _yaml_entries(path: Path, source: str, table) -> list[_Entry]:
    """The override file flattened to dotted paths (see the module docstring)."""
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigOverrideError(
            f"cannot load override file ({source}): {exc}", source=source
        ) from None
    if data is None:
        return []
    if not isinstance(data, dict) or not isinstance(data.get("stages", {}), dict):
        raise ConfigOverrideError(
            f"override file ({source}) must be a mapping of top-level fields plus 'stages:', "
            "a mapping from stage name to its fields",
            source=source,
        )
    entries: list[_Entry] = []
    for key, value in data.items():
        if key == "stages":
            for stage, fields in value.items():
                _flatten(str(stage), fields, table, entries)
        else:
            _flatten(str(key), value, table, entries)
    return entries


def _flatten(path: str, value: Any, table, out: list[_Entry]) -> None:
    if path in table or not isinstance(value, dict) or not value:
        out.append((path, value, None))
        return
    for key, sub in value.items():
        _flatten(f"{path}.{key}", sub, table, out)


# ----------------------------------------------------------------------------- result


@dataclass(frozen=True)
class ResolvedConfig:
    """The resolved pipeline config and where each value came from.

    Attributes:
        config: a new validated instance of the defaults' class.
        provenance: every settable leaf path -> ``"default"``, ``"yaml:<file>"`` or ``"cli"``.
        defaults: the model defaults it was resolved from, every factory knob filled in
            (the caller's object is not modified).
    """

    config: PipelineConfig
    provenance: dict[str, str]
    defaults: PipelineConfig
    _leaves: dict[str, _Leaf] = field(repr=False)

    def to_yaml(self) -> str:
        """The whole resolved pipeline as YAML, stages as a list in pipeline order."""
        data = self.config.model_dump(mode="json", serialize_as_any=True)
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True)

    def diff_yaml(self) -> str:
        """Only the values that differ from the defaults, in override-file shape (it loads
        back as an override file), each commented ``# old -> new (source)``."""
        tree: dict[str, Any] = {}
        for path, leaf in self._leaves.items():
            old, new = _get(self.defaults, leaf), _get(self.config, leaf)
            if _same(old, new):
                continue
            keys = leaf.segs if leaf.owner is None else ("stages", leaf.owner, *leaf.segs)
            node = tree
            for key in keys[:-1]:
                node = node.setdefault(key, {})
            note = f"{_render(old)} -> {_render(new)} ({self.provenance[path]})"
            node[keys[-1]] = (new, note)
        if not tree:
            return "{}  # no differences from the model defaults\n"
        return "".join(_render_tree(tree, 0))

    def provenance_text(self) -> str:
        """One line per settable leaf: ``path = value  # source``."""
        return "".join(
            f"{path} = {_render(_get(self.config, leaf))}  # {self.provenance[path]}\n"
            for path, leaf in self._leaves.items()
        )


def _render(value: Any) -> str:
    """``value`` as a one-line YAML flow value."""
    text = yaml.safe_dump(
        to_jsonable_python(value, fallback=repr),
        default_flow_style=True,
        width=1_000_000,
        allow_unicode=True,
    ).strip()
    return text[:-3].strip() if text.endswith("\n...") else text


def _render_tree(tree: dict[str, Any], depth: int):
    pad = "  " * depth
    for key, node in tree.items():
        if isinstance(node, dict):
            yield f"{pad}{_render(key)}:\n"
            yield from _render_tree(node, depth + 1)
        else:
            value, note = node
            yield f"{pad}{_render(key)}: {_render(value)}  # {note}\n"


def resolve_config(
    defaults: PipelineConfig, yaml_path: Path | None, cli: list[tuple[str, str]]
) -> ResolvedConfig:
    """Resolve ``defaults`` < ``yaml_path`` file < ``cli`` overrides.

    Args:
        defaults: the model's config (any PipelineConfig subclass); never modified.
        yaml_path: optional override file (format in the module docstring).
        cli: ``(path, text)`` pairs, e.g. from :func:`parse_cli_overrides`.

    Returns:
        The resolved config (same class as ``defaults``) with per-leaf provenance.

    Raises:
        ConfigOverrideError: unknown or topology path, invalid value, conflicting values at
            one precedence level, unreadable or malformed override file.
    """
    defaults, annotations = _with_every_knob(defaults)
    table = _leaf_table(defaults, annotations)
    merged: dict[str, _Override] = {}
    if yaml_path is not None:
        source = f"yaml:{yaml_path}"
        merged.update(_compile(_yaml_entries(yaml_path, source, table), source, table, defaults))
    cli_entries: list[_Entry] = [(path, None, text) for path, text in cli]
    merged.update(_compile(cli_entries, CLI_SOURCE, table, defaults))
    config = _apply(defaults, merged, table)
    provenance = {p: merged[p].source if p in merged else DEFAULT_SOURCE for p in table}
    return ResolvedConfig(config, provenance, defaults, table)
