"""``omnistage config resolve``: show the pipeline config ``serve`` would run."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from omnistage.cli.models import ModelArgs, resolve_model
from omnistage.cli.options import option_group

__all__ = ["config_app"]

config_app = typer.Typer(help="Inspect pipeline configs.", no_args_is_help=True)


class Show(StrEnum):
    yaml = "yaml"
    diff = "diff"
    provenance = "provenance"


@config_app.command(
    "resolve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog="Takes the same model, --config and --<path> VALUE override flags as serve.",
)
@option_group(ModelArgs, "model")
def resolve(
    ctx: typer.Context,
    show: Annotated[
        Show,
        typer.Option(
            help="yaml: the whole resolved config; diff: only values changed from the model "
            "defaults (loads back as a --config file); provenance: every value and its source."
        ),
    ] = Show.yaml,
    *,
    model: ModelArgs,
) -> None:
    """Print the resolved pipeline config (model defaults < --config file < CLI flags)."""
    resolved = resolve_model(model, ctx.args)
    text = {
        Show.yaml: resolved.to_yaml,
        Show.diff: resolved.diff_yaml,
        Show.provenance: resolved.provenance_text,
    }[show]()
    typer.echo(text, nl=False)
