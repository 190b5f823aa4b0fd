"""Measure how Piper's duration follows ``speed``: the voice's own length scale (the old
mapping, length_scale / speed) against omnistage's time stretch (:mod:`omnistage.models.
piper.modeling.speed`). Prints, per sentence and speed, duration(speed) x speed /
duration(1): 1.0 is OpenAI's definition. Noise is 0 so both runs are deterministic.
``--wer`` also prints pocketsphinx's corpus WER of the stretched audio per speed (needs
``pip install -e '.[bench]'``).

    python tools/piper_speed.py [--wer]
"""

from __future__ import annotations

import sys

from omnistage.models.piper.modeling import (
    PiperPhonemizer,
    PiperSynthesizer,
    SynthesisItem,
    change_speed,
    default_voice_path,
    load_voice_spec,
)

SENTENCES = (
    "Hello there, how are you doing today?",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Yes.",
    "In 1984, the committee met three times to discuss the budget.",
)
SPEEDS = (0.25, 0.5, 2.0, 4.0)


def main() -> None:
    spec = load_voice_spec(default_voice_path())
    synthesizer, phonemizer = PiperSynthesizer.load(spec, 2), PiperPhonemizer(spec)

    def synthesize(ids: list[int], length_scale: float) -> int:
        return len(synthesizer.synthesize_batch([SynthesisItem(ids, 0.0, length_scale, 0.0, None)])[0])

    print(f"{'sentence':24} {'speed':>5} {'length_scale':>12} {'time stretch':>12}")
    for sentence in SENTENCES:
        ids = phonemizer.phonemize(sentence)
        normal = synthesizer.synthesize_batch([SynthesisItem(ids, 0.0, spec.length_scale, 0.0, None)])[0]
        for speed in SPEEDS:
            scaled = synthesize(ids, spec.length_scale / speed) * speed / len(normal)
            stretched = len(change_speed(normal, spec.sample_rate, speed)) * speed / len(normal)
            print(f"{sentence[:24]:24} {speed:5} {scaled:12.3f} {stretched:12.3f}")
    if "--wer" in sys.argv:
        print_wer(synthesizer, phonemizer, spec)


def print_wer(synthesizer: PiperSynthesizer, phonemizer: PiperPhonemizer, spec) -> None:
    import jiwer

    from omnistage.bench.asr import PocketSphinxASR
    from omnistage.bench.wer import normalize_for_wer

    asr = PocketSphinxASR()
    waves = [
        synthesizer.synthesize_batch([SynthesisItem(phonemizer.phonemize(s), 0.0, spec.length_scale, 0.0, None)])[0]
        for s in SENTENCES
    ]
    references = [normalize_for_wer(s) for s in SENTENCES]
    for speed in (1.0, *SPEEDS):
        heard = [asr.transcribe(change_speed(w, spec.sample_rate, speed), spec.sample_rate) for w in waves]
        wer = jiwer.wer(references, [normalize_for_wer(h) for h in heard])
        print(f"speed {speed}: pocketsphinx WER {wer:.3f}")


if __name__ == "__main__":
    main()
