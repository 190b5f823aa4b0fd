"""Model selection shared by ``serve`` and ``config resolve``, and the ``models`` listing
(models outside ``omnistage.models`` come from ``OMNISTAGE_EXTRA_MODELS``, see
:mod:`omnistage.serve.registry`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from omnistage.cli.options import fail
from omnistage.config.overrides import (
    ConfigOverrideError,
    ResolvedConfig,
    parse_cli_overrides,
    resolve_config,
)
from omnistage.serve.model import ModelConfig
from omnistage.serve.registry import (
    EXTRA_MODELS_ENV,
    ModelRegistry,
    RegistryError,
    UnknownVariantError,
    UnsupportedLoadFormatError,
)

__all__ = ["EXTRA_MODELS_ENV", "ModelArgs", "list_models", "load_registry", "resolve_model"]



def load_registry() -> ModelRegistry:
    """The discovered models plus those named in ``OMNISTAGE_EXTRA_MODELS``.

    Raises:
        RegistryError: an extra model cannot be imported or clashes with a registered one.
    """
    return ModelRegistry.discover()


@dataclass(frozen=True)
class ModelArgs:
    """The options choosing and configuring the model (``serve`` and ``config resolve``)."""

    model_path: Annotated[
        str | None,
        typer.Option(
            help="Checkpoint directory, Piper .onnx voice, or registered model name "
            r"\[default: the registry's default model].",
            show_default=False,
        ),
    ] = None
    config: Annotated[
        Path | None,
        typer.Option(
            help="YAML override file (precedence: model defaults < this file < CLI flags).",
            exists=True,
            dir_okay=False,
            show_default=False,
        ),
    ] = None
    variant: Annotated[
        str | None, typer.Option(help="Named variant of the model.", show_default=False)
    ] = None
    load_format: Annotated[
        str | None,
        typer.Option(
            help="How weights are made: 'dummy' builds random weights on the device from "
            "the checkpoint's config.json alone (the vLLM/SGLang convention), for models "
            "that offer it \\[default: load the checkpoint's weights].",
            show_default=False,
        ),
    ] = None
    max_concurrent_requests: Annotated[
        int | None,
        typer.Option(
            help="Requests admitted at once (sets the pipeline's max_concurrent_requests).",
            show_default=False,
        ),
    ] = None


def _registry_or_exit() -> ModelRegistry:
    try:
        return load_registry()
    except RegistryError as exc:
        fail(str(exc))


def resolve_model(args: ModelArgs, extra_args: list[str]) -> ResolvedConfig:
    """The resolved config for ``args`` plus ``--<path> VALUE`` overrides in ``extra_args``;
    exits with status 2 and a message on any user error."""
    registry = _registry_or_exit()
    try:
        defaults = registry.resolve(args.model_path, args.variant, args.load_format)
    except (FileNotFoundError, ValueError) as exc:
        option = "--variant" if isinstance(exc, UnknownVariantError) else "--model-path"
        option = "--load-format" if isinstance(exc, UnsupportedLoadFormatError) else option
        fail(f"{option}: {exc}")
    try:
        cli = parse_cli_overrides(extra_args)
        if args.max_concurrent_requests is not None:
            cli.append(("max_concurrent_requests", str(args.max_concurrent_requests)))
        return resolve_config(defaults, args.config, cli)
    except ConfigOverrideError as exc:
        fail(str(exc))


def _models_table(registry: ModelRegistry) -> Table:
    default = next((e for e in registry.entries.values() if e.entry.is_default), None)
    table = Table(title="registered models")
    for name in ("architecture", "aliases", "embedded models", "variants", "init-random", "default"):
        table.add_column(name, overflow="fold")
    for architecture in sorted(registry.entries):
        entry = registry.entries[architecture]
        cls = entry.entry
        table.add_row(
            architecture,
            ", ".join(cls.aliases) or "-",
            ", ".join(cls.embedded_models) or "-",
            ", ".join(sorted(entry.variants)) or "-",
            _random_offer(cls),
            "yes" if entry is default else "",
        )
    return table


def _random_offer(cls: type[ModelConfig]) -> str:
    offer = cls.random_checkpoint
    if offer is None:
        return "-"
    return " x ".join(", ".join(values) for values in (offer.sizes, offer.types) if values)


def list_models() -> None:
    """Print the registered models as a table, then what ``serve`` uses by default."""
    registry = _registry_or_exit()
    console = Console()
    console.print(_models_table(registry))
    default = next((e.entry for e in registry.entries.values() if e.entry.is_default), None)
    if default is None:
        console.print("no default model: pass --model-path to serve")
    elif default.embedded_models:
        console.print(f"default: {default.embedded_models[0]} ({default.architecture})")
