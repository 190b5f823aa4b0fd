"""Benchmark samples: a seed-tts-eval ``meta.lst`` or the built-in sentences.

seed-tts-eval lists one utterance per line, fields separated by ``|``::

    id|ref_text|ref_audio|target_text[|target_audio]

``ref_text``/``ref_audio`` are the voice prompt (transcript and wav, relative to the list's
directory), ``target_text`` is the text to synthesize; the optional fifth field (ground-truth
recording of the target text, in some lists) is kept as ``target_audio``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from omnistage.bench.sentences import BUILTIN_SENTENCES

__all__ = ["BenchSample", "builtin_samples", "load_meta_lst", "load_samples", "parse_meta_lst"]


@dataclass(frozen=True)
class BenchSample:
    """One text to synthesize.

    Attributes:
        id: unique sample id.
        text: the text sent as ``input`` (seed-tts-eval ``target_text``).
        ref_text: transcript of the voice prompt, if any.
        ref_audio: absolute path of the voice prompt wav, if any.
        target_audio: absolute path of a ground-truth recording of ``text``, if any.
    """

    id: str
    text: str
    ref_text: str | None = None
    ref_audio: Path | None = None
    target_audio: Path | None = None


def parse_meta_lst(lines: Iterable[str], base_dir: Path) -> list[BenchSample]:
    """Parse ``meta.lst`` lines; blank lines and lines starting with ``#`` are skipped.

    Args:
        lines: the file's lines.
        base_dir: directory the relative audio paths are resolved against.

    Raises:
        ValueError: a line has not 4 or 5 fields, an empty id or text, or a duplicate id
            (the message names the 1-based line number).
    """
    samples: list[BenchSample] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split("|")]
        if len(fields) not in (4, 5):
            raise ValueError(
                f"meta.lst line {number}: expected 4 or 5 '|' fields, got {len(fields)}"
            )
        sample_id, ref_text, ref_audio, text = fields[:4]
        if not sample_id or not text:
            raise ValueError(f"meta.lst line {number}: empty id or target text")
        if sample_id in seen:
            raise ValueError(f"meta.lst line {number}: duplicate id {sample_id!r}")
        seen.add(sample_id)
        target = fields[4] if len(fields) == 5 and fields[4] else None
        samples.append(
            BenchSample(
                id=sample_id,
                text=text,
                ref_text=ref_text or None,
                ref_audio=(base_dir / ref_audio).resolve() if ref_audio else None,
                target_audio=(base_dir / target).resolve() if target else None,
            )
        )
    return samples


def load_meta_lst(path: str | Path) -> list[BenchSample]:
    """Read a seed-tts-eval ``meta.lst`` (UTF-8); audio paths are relative to its directory.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a malformed line (see :func:`parse_meta_lst`).
    """
    path = Path(path)
    with path.open(encoding="utf-8") as file:
        return parse_meta_lst(file, path.parent)


def builtin_samples() -> list[BenchSample]:
    """The :data:`~omnistage.bench.sentences.BUILTIN_SENTENCES`, ids ``builtin-00``..."""
    return [BenchSample(id=f"builtin-{i:02d}", text=t) for i, t in enumerate(BUILTIN_SENTENCES)]


def load_samples(meta_lst: str | Path | None = None, limit: int | None = None) -> list[BenchSample]:
    """Samples from ``meta_lst`` when given, else the built-in sentences; first ``limit`` only.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_meta_lst`; ValueError for ``limit < 1``.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    samples = load_meta_lst(meta_lst) if meta_lst is not None else builtin_samples()
    return samples[:limit] if limit is not None else samples
