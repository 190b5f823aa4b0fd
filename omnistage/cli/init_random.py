"""``omnistage init-random``: write a random-weight checkpoint in a model's real layout.

What can be written comes from the registry: each model's ``EntryClass.random_checkpoint``
(:class:`~omnistage.serve.model.RandomCheckpoint`) names its writer by dotted path,
imported only when chosen, and the sizes and types it offers; ``--list`` prints them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from omnistage.cli.models import load_registry
from omnistage.cli.options import fail
from omnistage.config.hooks import import_callable
from omnistage.core.errors import PipelineConfigError
from omnistage.serve.model import RandomCheckpoint
from omnistage.serve.registry import RegistryError

__all__ = ["init_random", "random_checkpoint_offers"]


def random_checkpoint_offers() -> dict[str, RandomCheckpoint]:
    """Architecture -> its writer, for every registered model that has one.

    Raises:
        RegistryError: see :func:`~omnistage.cli.models.load_registry`.
    """
    registry = load_registry()
    offers = {arch: e.entry.random_checkpoint for arch, e in sorted(registry.entries.items())}
    return {arch: offer for arch, offer in offers.items() if offer is not None}


def _describe(offers: dict[str, RandomCheckpoint]) -> str:
    lines = []
    for arch, offer in offers.items():
        types = f"; --type {' | '.join(offer.types)}" if offer.types else ""
        lines.append(f"  --arch {arch}: --size {' | '.join(offer.sizes)}{types}")
    return "\n".join(lines) or "  (no registered model has a random-checkpoint writer)"


def init_random(
    out_dir: Annotated[
        Path | None, typer.Argument(help="Directory to write (created; existing files are overwritten).")
    ] = None,
    arch: Annotated[str | None, typer.Option("--arch", help="Architecture (--list shows them).")] = None,
    size: Annotated[str | None, typer.Option("--size", help="Size \\[default: the model's first].")] = None,
    model_type: Annotated[
        str | None, typer.Option("--type", help="Model type, for models with several \\[default: the first].")
    ] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Same seed, device and torch build: same bytes.")] = 0,
    device: Annotated[str, typer.Option("--device", help="Where tensors are drawn: cpu or cuda (real sizes).")] = "cpu",
    list_offers: Annotated[
        bool, typer.Option("--list", help="List each model's sizes and types, and exit.")
    ] = False,
) -> None:
    """Write a random-weight checkpoint in a registered model's real layout."""
    try:
        offers = random_checkpoint_offers()
    except RegistryError as exc:
        fail(str(exc))
    if list_offers:
        typer.echo("random checkpoints:\n" + _describe(offers))
        return
    if arch not in offers:
        got = "--arch is required" if arch is None else f"unknown --arch {arch!r}"
        fail(f"{got}; models with a random-checkpoint writer:\n{_describe(offers)}")
    offer = offers[arch]
    size = size or offer.sizes[0]
    if size not in offer.sizes:
        fail(f"--size {size!r} is not offered by {arch}; sizes: {', '.join(offer.sizes)}")
    if model_type is not None and model_type not in offer.types:
        allowed = f"types: {', '.join(offer.types)}" if offer.types else "it has one type (no --type)"
        fail(f"--type {model_type!r} is not offered by {arch}; {allowed}")
    model_type = model_type or (offer.types[0] if offer.types else None)
    if device not in ("cpu", "cuda"):
        fail(f"--device must be cpu or cuda, got {device!r}")
    if out_dir is None:
        fail("OUT_DIR is required")
    try:
        writer = import_callable(offer.writer, what="random-checkpoint writer")
    except PipelineConfigError as exc:
        fail(str(exc))
    out = writer(out_dir, size, model_type, seed=seed, device=device)
    kind = f"{size}, {model_type}" if model_type else size
    typer.echo(f"wrote {arch} ({kind}, seed {seed}) to {out}")
