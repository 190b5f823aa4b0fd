"""The ``omnistage`` command: ``serve``, ``config resolve``, ``models``, ``bench speed|wer``,
``init-random``."""

from __future__ import annotations

import typer

from omnistage.cli.bench import bench_app
from omnistage.cli.config import config_app
from omnistage.cli.init_random import init_random
from omnistage.cli.models import list_models
from omnistage.cli.serve import SERVE_EPILOG, serve

__all__ = ["app", "main"]

OVERRIDE_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}

app = typer.Typer(
    help="Serve speech models as pipelines of stages behind an OpenAI-compatible API.",
    no_args_is_help=True,
    add_completion=False,
)
app.command("serve", context_settings=OVERRIDE_ARGS, epilog=SERVE_EPILOG)(serve)
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")
app.command("init-random")(init_random)


@app.command("models")
def models() -> None:
    """List the registered model architectures, their names and variants, and the default."""
    list_models()


def main() -> None:
    """Console-script entry point."""
    app(prog_name="omnistage")


if __name__ == "__main__":
    main()
