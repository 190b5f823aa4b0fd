"""Benchmark clients: statistics, report aggregation, parsing, normalization, HTTP handling
(over ``httpx.MockTransport``, no server) and PocketSphinx on Piper-synthesized speech."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time

import httpx
import jiwer
import numpy as np
import pytest
import soundfile
from hypothesis import example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from omnistage.bench.asr import PocketSphinxASR, WhisperASR, to_asr_input
from omnistage.bench.dataset import BenchSample, builtin_samples, load_meta_lst, load_samples
from omnistage.bench.speed import (
    DEFAULT_PCM_SAMPLE_RATE,
    Distribution,
    SpeechResult,
    SpeechTarget,
    SpeedOptions,
    percentile,
    plot_speed_report,
    print_speed_report,
    request_speech,
    run_speed,
    summarize_level,
    ttfa_phases,
    write_speed_json,
)
from omnistage.bench.wer import (
    TranscribedSample,
    WerOptions,
    build_wer_report,
    normalize_for_wer,
    print_wer_report,
    run_wer,
    write_wer_json,
)

RATE = 16000


def _result(i: int, ok: bool = True, error: str | None = None) -> SpeechResult:
    if not ok:
        return SpeechResult(f"s{i}", False, latency_ms=5.0, error=error)
    return SpeechResult(f"s{i}", True, latency_ms=100.0 * i, ttfa_ms=10.0 * i, audio_s=float(i))


# ------------------------------------------------------------------------------ statistics


def test_percentile_interpolates_linearly():
    assert percentile(list(range(1, 101)), 50) == pytest.approx(50.5)
    assert percentile([0, 10], 90) == pytest.approx(9.0)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


@settings(deadline=None)  # a timing limit would fail on a loaded machine, not on a wrong result
@given(
    st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100), st.floats(0, 100)
)
def test_percentile_is_monotone_and_bounded(values, q1, q2):
    low, high = sorted((q1, q2))
    assert min(values) <= percentile(values, low) <= percentile(values, high) <= max(values)


def test_distribution_of_nothing_is_empty():
    assert Distribution.of([]) == Distribution(None, None, None, None, None)


def test_summarize_level_from_synthetic_timings():
    results = [_result(i) for i in range(1, 11)]
    results += [_result(0, False, "HTTP 500: boom")] * 3 + [_result(0, False, "timeout")]
    stats = summarize_level(4, results, wall_s=5.0)
    assert (stats.num_requests, stats.num_ok, stats.num_failed) == (14, 10, 4)
    assert stats.errors == ["HTTP 500: boom", "timeout"]
    assert stats.latency_ms.mean == pytest.approx(550.0)
    assert stats.latency_ms.p50 == pytest.approx(550.0)
    assert stats.latency_ms.p90 == pytest.approx(910.0)
    assert stats.ttfa_ms.p99 == pytest.approx(99.1) and stats.ttfa_ms.max == pytest.approx(100.0)
    assert stats.rtf.mean == pytest.approx(0.1) and stats.rtf.p50 == pytest.approx(0.1)
    assert stats.audio_s_total == pytest.approx(55.0)
    assert stats.audio_throughput == pytest.approx(11.0)
    assert stats.request_throughput == pytest.approx(2.0)


def test_summarize_level_keeps_five_distinct_errors():
    results = [_result(0, False, f"error {i % 7}") for i in range(20)]
    stats = summarize_level(1, results, wall_s=1.0)
    assert stats.errors == [f"error {i}" for i in range(5)]
    assert stats.latency_ms.p50 is None and stats.audio_throughput == 0.0


def test_speed_options_validate():
    target = SpeechTarget("http://x")
    for bad in (
        dict(concurrencies=()),
        dict(concurrencies=(0,)),
        dict(num_requests=0),
        dict(stream=True, response_format="wav"),
        dict(warmup=-1),
    ):
        with pytest.raises(ValueError):
            SpeedOptions(target, **bad)


# ------------------------------------------------------------------------------ datasets


def test_meta_lst_parsing(tmp_path):
    meta = tmp_path / "en" / "meta.lst"
    meta.parent.mkdir()
    meta.write_text(
        "# comment\n"
        "utt1|prompt one.|prompt-wavs/a.wav|Target one.\n"
        "\n"
        "utt2|prompt two|prompt-wavs/b.wav|Target two|wavs/utt2.wav\n",
        encoding="utf-8",
    )
    first, second = load_meta_lst(meta)
    assert first == BenchSample(
        "utt1", "Target one.", "prompt one.", meta.parent / "prompt-wavs/a.wav"
    )
    assert second.target_audio == meta.parent / "wavs/utt2.wav"
    assert load_samples(meta, limit=1) == [first]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("a|b|c\n", "line 1: expected 4 or 5"),
        ("x|r|w|t\n\nx|r|w|t\n", "line 3: duplicate id"),
        ("x|r|w|\n", "line 1: empty id"),
    ],
)
def test_meta_lst_errors_name_the_line(tmp_path, content, message):
    meta = tmp_path / "meta.lst"
    meta.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        load_meta_lst(meta)


def test_builtin_samples():
    samples = load_samples()
    assert samples == builtin_samples() and 25 <= len(samples) <= 40
    assert len({s.id for s in samples}) == len(samples)
    assert any("?" in s.text for s in samples) and any(len(s.text) > 300 for s in samples)
    assert any(c.isdigit() for s in samples for c in s.text)
    with pytest.raises(ValueError):
        load_samples(limit=0)


# ------------------------------------------------------------------------------ WER scoring


@pytest.mark.parametrize(
    ("written", "spoken"),
    [
        ("It costs $45.99!", "it costs forty-five dollars ninety-nine cents"),
        ("She came 21st, he was 2nd.", "she came twenty first he was second"),
        ("Meet at 9:30 or 10:05.", "meet at nine thirty or ten oh five"),
        ("Up 7.5% in 1998", "up seven point five percent in nineteen ninety-eight"),
        (
            "1,250,000 people; -5 degrees",
            "one million two hundred fifty thousand people minus five degrees",
        ),
        ('He said, "It\'s fine."', "he said it's fine"),
        ("At 7 a.m. or 5 P.M.", "at seven am or five pm"),
        ("0,0000 and 1,000", "zero zero and one thousand"),
    ],
)
def test_normalizer_maps_written_and_spoken_forms_together(written, spoken):
    assert normalize_for_wer(written) == normalize_for_wer(spoken)
    assert not any(c.isdigit() for c in normalize_for_wer(written))


@settings(max_examples=300, deadline=None)  # num2words' first calls are slow on a loaded machine
@given(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80))
@example(text="P:M")  # was "p m", then "pm"
@example(text="0,0000")  # was "zero 0": a digit group cut mid-run left a digit behind
def test_normalizer_is_idempotent(text):
    once = normalize_for_wer(text)
    assert normalize_for_wer(once) == once and once == once.strip()


def _transcribed(sample_id: str, ref: str, hyp: str, audio_s: float = 2.0) -> TranscribedSample:
    return TranscribedSample(sample_id, ref, hyp, audio_s=audio_s, latency_ms=500.0)


def test_wer_report_is_corpus_level():
    report = build_wer_report(
        [
            _transcribed("good", "A b, c d.", "a b c d"),
            _transcribed("bad", "E f!", "e g", audio_s=1.0),
            _transcribed("silent", "...", "anything"),
        ],
        failures=["x: HTTP 500"],
        wall_s=2.0,
        worst_n=1,
    )
    refs, hyps = ["a b c d", "e f"], ["a b c d", "e g"]
    assert report.wer == pytest.approx(1 / 6) == pytest.approx(jiwer.wer(refs, hyps))
    assert report.cer == pytest.approx(jiwer.cer(refs, hyps))
    assert (report.num_samples, report.num_scored, report.num_failed) == (4, 2, 2)
    assert [s.id for s in report.worst] == ["bad"] and report.worst[0].wer == 0.5
    assert report.rtf_mean == pytest.approx((0.25 + 0.5 + 0.25) / 3)
    assert report.throughput == pytest.approx(1.0)
    assert report.errors[0] == "x: HTTP 500" and "silent" in report.errors[1]


def test_wer_report_without_scored_samples():
    report = build_wer_report([], failures=["a: down"], wall_s=1.0)
    assert report.wer is None and report.num_failed == 1 and report.worst == []


# ------------------------------------------------------------------------------ HTTP client


def _pcm(seconds: float, rate: int = RATE) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2").tobytes()


def _wav(seconds: float, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    audio = np.frombuffer(_pcm(seconds, rate), "<i2")
    soundfile.write(buffer, audio, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def _server(requests: list[dict]):
    """A fake speech endpoint: 0.1 s of audio per input word; input "fail" -> HTTP 500."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append({"body": body, "auth": request.headers.get("Authorization")})
        if body["input"] == "fail":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        seconds = 0.1 * len(body["input"].split())
        if body["response_format"] == "wav":
            return httpx.Response(200, content=_wav(seconds))
        return httpx.Response(200, content=_pcm(seconds), headers={"X-Sample-Rate": str(RATE)})

    return httpx.MockTransport(handle)


def _request(sample: BenchSample, target: SpeechTarget, **kwargs) -> SpeechResult:
    async def go():
        async with httpx.AsyncClient(transport=_server([])) as client:
            return await request_speech(client, target, sample, **kwargs)

    return asyncio.run(go())


def test_request_body_and_headers():
    target = SpeechTarget("http://h/", model="m", api_key="k", extra_fields={"speed": 1.5})
    assert target.url == "http://h/v1/audio/speech"
    assert target.headers() == {"Authorization": "Bearer k"}
    body = target.body("hi", stream=True, response_format="pcm")
    assert body == {
        "input": "hi",
        "response_format": "pcm",
        "stream": True,
        "stream_format": "audio",
        "model": "m",
        "speed": 1.5,
    }
    # a whole file must be asked for: OpenAI-style servers stream by default
    assert SpeechTarget("http://h").body("hi", False, "wav")["stream"] is False


@pytest.mark.parametrize("response_format", ["pcm", "wav"])
def test_request_measures_audio(response_format):
    sample = BenchSample("a", "one two three four five")
    stream = response_format == "pcm"
    result = _request(
        sample,
        SpeechTarget("http://h"),
        stream=stream,
        response_format=response_format,
        keep_audio=True,
    )
    assert result.ok and result.sample_rate == RATE
    assert result.audio_s == pytest.approx(0.5)
    assert 0 <= result.ttfa_ms <= result.latency_ms
    assert result.audio.dtype == np.float32 and np.max(np.abs(result.audio)) == pytest.approx(
        0.3, abs=1e-3
    )


def test_request_failures_are_results():
    result = _request(BenchSample("f", "fail"), SpeechTarget("http://h"), stream=True)
    assert not result.ok and "HTTP 500" in result.error and "boom" in result.error


def test_pcm_without_rate_header_uses_openai_rate():
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=b"\0\0" * 2400))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await request_speech(
                client, SpeechTarget("http://h"), BenchSample("a", "x"), stream=True
            )

    result = asyncio.run(go())
    assert result.sample_rate == DEFAULT_PCM_SAMPLE_RATE
    assert result.audio_s == pytest.approx(2400 / DEFAULT_PCM_SAMPLE_RATE)


def test_run_speed_over_mock_server(tmp_path):
    requests: list[dict] = []
    samples = [
        BenchSample("a", "one two"),
        BenchSample("b", "fail"),
        BenchSample("c", "one two three"),
    ]
    target = SpeechTarget("http://h", model="piper", api_key="secret")
    options = SpeedOptions(
        target, concurrencies=(1, 3), num_requests=6, warmup=1, show_progress=False
    )
    report = asyncio.run(run_speed(options, samples, transport=_server(requests)))
    assert len(requests) == 1 + 6 + 6
    assert {r["auth"] for r in requests} == {"Bearer secret"}
    assert [level.concurrency for level in report.levels] == [1, 3]
    for level in report.levels:
        assert (level.num_ok, level.num_failed) == (4, 2)
        assert level.audio_s_total == pytest.approx(2 * 0.2 + 2 * 0.3)
        assert level.errors and "HTTP 500" in level.errors[0]
    write_speed_json(report, tmp_path / "speed.json")
    saved = json.loads((tmp_path / "speed.json").read_text())
    assert saved["levels"][1]["latency_ms"]["p50"] == report.levels[1].latency_ms.p50
    console = Console(file=io.StringIO(), width=200)
    print_speed_report(report, console)
    assert "4/2" in console.file.getvalue() and "HTTP 500" in console.file.getvalue()


def test_failing_warm_up_stops_the_benchmark():
    samples = [BenchSample("b", "fail")]
    options = SpeedOptions(SpeechTarget("http://h"), concurrencies=(1,), warmup=1, show_progress=False)
    with pytest.raises(RuntimeError, match="warm-up request failed"):
        asyncio.run(run_speed(options, samples, transport=_server([])))


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    report = asyncio.run(
        run_speed(
            SpeedOptions(SpeechTarget("http://h"), warmup=0, show_progress=False),
            [BenchSample("a", "hi")],
            transport=_server([]),
        )
    )
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_speed_report(report, tmp_path / "plot.png")


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    options = SpeedOptions(SpeechTarget("http://h"), concurrencies=(1, 2), warmup=0, show_progress=False)
    report = asyncio.run(run_speed(options, [BenchSample("a", "hi")], transport=_server([])))
    plot_speed_report(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _LossyASR:
    """Test double: "hears" the text the fake server was asked for, minus its last word."""

    name = "lossy"

    def __init__(self, texts_by_duration: dict[float, str]) -> None:
        self._texts = texts_by_duration

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> str:
        text = self._texts[round(audio.size / sample_rate, 2)]
        return " ".join(text.split()[:-1])


def test_run_wer_over_mock_server(tmp_path):
    samples = [
        BenchSample("a", "One two three four."),
        BenchSample("b", "fail"),
        BenchSample("c", "Five six."),
    ]
    asr = _LossyASR({round(0.1 * len(s.text.split()), 2): s.text for s in samples})
    options = WerOptions(SpeechTarget("http://h"), concurrency=2, worst_n=5, show_progress=False)
    requests: list[dict] = []
    report = asyncio.run(run_wer(options, samples, asr, transport=_server(requests)))
    assert {r["body"]["response_format"] for r in requests} == {"wav"}
    assert (report.num_samples, report.num_scored, report.num_failed) == (3, 2, 1)
    assert report.wer == pytest.approx(2 / 6)  # one deletion in each of 4 + 2 words
    assert [s.id for s in report.worst] == ["c", "a"] and report.asr == "lossy"
    write_wer_json(report, tmp_path / "wer.json")
    assert json.loads((tmp_path / "wer.json").read_text())["wer"] == report.wer
    console = Console(file=io.StringIO(), width=200)
    print_wer_report(report, console)
    assert "33.33%" in console.file.getvalue()


# ------------------------------------------------------------------------------ ASR backends


def test_asr_input_is_resampled_to_16k():
    audio = np.zeros(22050, np.float32)
    assert to_asr_input(audio, 22050).shape == (16000,)
    with pytest.raises(ValueError):
        to_asr_input(np.zeros((2, 10), np.float32), 16000)


def test_whisper_errors_are_clear(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        WhisperASR(tmp_path / "nowhere")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match="pip install transformers"):
        WhisperASR(tmp_path)


@pytest.fixture(scope="module")
def pocketsphinx():
    return PocketSphinxASR()


def test_pocketsphinx_transcribes_piper_speech(pocketsphinx):
    from omnistage.models.piper.modeling import (
        PiperPhonemizer,
        PiperSynthesizer,
        SynthesisItem,
        default_voice_path,
        load_voice_spec,
    )

    spec = load_voice_spec(default_voice_path())
    text = "hello world, this is a test"
    ids = PiperPhonemizer(spec).phonemize(text)
    audio = PiperSynthesizer.load(spec).synthesize_batch([SynthesisItem(ids, 0.0, 1.0, 0.0)])[0]
    hypothesis = pocketsphinx.transcribe(audio, spec.sample_rate)
    # measured: "hello world this is a test" (WER 0); one error of six words allowed
    assert jiwer.wer(normalize_for_wer(text), normalize_for_wer(hypothesis)) <= 1 / 6


def test_pocketsphinx_on_silence(pocketsphinx):
    assert pocketsphinx.transcribe(np.zeros(0, np.float32), RATE) == ""
    assert len(pocketsphinx.transcribe(np.zeros(RATE, np.float32), RATE).split()) <= 1


def test_normalizer_joins_meridiem_letters_as_an_asr_writes_them():
    from omnistage.bench.wer import normalize_for_wer

    assert normalize_for_wer("Gate B12 at 6:45 p.m.") == normalize_for_wer("gate b twelve at six forty five pm")
    assert normalize_for_wer("nine thirty a m") == "nine thirty am"
    assert normalize_for_wer("a map") == "a map"


def test_ttfa_phases_from_a_timeline_header_sum_to_the_ttfa():
    phases = ttfa_phases(
        "received=0.00;admitted=1.50;engine.prefill=4.00;vocoder.first_output=9.25", 12.0
    )
    assert [name for name, _ in phases] == [
        "admitted",
        "engine.prefill",
        "vocoder.first_output",
        "client",
    ]
    assert [ms for _, ms in phases] == pytest.approx([1.5, 2.5, 5.25, 2.75])
    assert sum(ms for _, ms in phases) == pytest.approx(12.0)
    assert ttfa_phases(None, 5.0) == ()
    assert ttfa_phases("received=zero", 5.0) == ()


def test_slowest_tenth_phases_average_the_tail_by_ttfa():
    """20 requests whose TTFA is 10 * i ms, each split into an admission phase of i ms and
    a prefill phase of the rest: the slowest tenth is the two slowest (i = 20, 19), so its
    admission mean is 19.5 ms; a failure is left out."""
    results = [
        SpeechResult(f"s{i}", True, latency_ms=100.0, ttfa_ms=10.0 * i, audio_s=1.0,
                     ttfa_phases_ms=(("admitted", float(i)), ("engine.prefill", 9.0 * i)))
        for i in range(1, 21)
    ] + [_result(99, ok=False, error="boom")]
    level = summarize_level(4, results, wall_s=1.0)
    assert level.slowest_ttfa_phases_ms == pytest.approx({"admitted": 19.5, "engine.prefill": 175.5})
    assert sum(level.slowest_ttfa_phases_ms.values()) == pytest.approx(195.0)
    assert level.ttfa_phases_ms == pytest.approx({"admitted": 10.5, "engine.prefill": 94.5})
    one = summarize_level(1, results[:1], wall_s=1.0)
    assert one.slowest_ttfa_phases_ms == one.ttfa_phases_ms
    assert summarize_level(1, [_result(1)], wall_s=1.0).slowest_ttfa_phases_ms == {}


def _timed_server(arrivals: list[float]):
    """A fake endpoint that records arrival times and sends a timeline header."""

    def handle(request: httpx.Request) -> httpx.Response:
        arrivals.append(time.perf_counter())
        headers = {
            "X-Sample-Rate": str(RATE),
            "X-Timeline": "received=0.00;admitted=0.50;vocoder.first_output=2.00",
        }
        return httpx.Response(200, content=_pcm(0.1), headers=headers)

    return httpx.MockTransport(handle)


def test_open_loop_sends_poisson_arrivals_at_the_rate_and_decomposes_ttfa():
    """An open-loop level at 200 requests/s: 40 requests whose gaps are exponential with
    mean 1/200 s (the seeded draw, checked against the arrival times within the event
    loop's slack), reported with its rate, and a TTFA decomposition that sums to the mean."""
    arrivals: list[float] = []
    options = SpeedOptions(
        SpeechTarget("http://h"),
        concurrencies=(),
        rates=(200.0,),
        num_requests=40,
        warmup=0,
        show_progress=False,
    )
    report = asyncio.run(
        run_speed(options, [BenchSample("a", "hi")], transport=_timed_server(arrivals))
    )
    (level,) = report.levels
    assert level.arrival_rate == 200.0 and level.num_ok == 40
    planned = np.cumsum(np.random.default_rng(0).exponential(1 / 200.0, 40))
    sent = np.asarray(sorted(arrivals)) - min(arrivals)
    assert np.abs(sent - (planned - planned[0])).max() < 0.05
    assert list(level.ttfa_phases_ms) == ["admitted", "vocoder.first_output", "client"]
    assert sum(level.ttfa_phases_ms.values()) == pytest.approx(level.ttfa_ms.mean)
    console = Console(file=io.StringIO(), width=200)
    print_speed_report(report, console)
    assert (
        "200/s peak" in console.file.getvalue() and "mean TTFA by phase" in console.file.getvalue()
    )


@pytest.mark.parametrize("rates", [(0.0,), (-1.0,), (float("nan"),)])
def test_bad_arrival_rates_are_refused(rates):
    with pytest.raises(ValueError, match="rates"):
        SpeedOptions(SpeechTarget("http://h"), concurrencies=(), rates=rates)
