"""OpenAI ``stop`` on ``POST /v1/chat/completions``, served for the tiny random Qwen3-Omni
(``--load-format dummy``, CPU) and spoken to with the OpenAI SDK: the reply ends before the
first stop string (within a token, across two, in the first token, at a boundary) with
finish_reason ``stop``, whole or streamed, the stream never showing the stop text; the
thinker stops generating at once; a stop never met changes nothing; a spoken reply voices
exactly the returned text (its transcript), the talker fed only its tokens; bad ``stop``
values are 400s naming the field; nothing is left behind."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import soundfile
from omni_fixtures import openai_client, serve_dummy

import omnistage.models.qwen3_omni.stages as omni_stages
from omnistage.models.qwen3_omni.processing import Qwen3OmniProcessor
from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint
from omnistage.models.qwen3_omni.stages import TalkerFeed, talker_frame_cap
from omnistage.testing.leaks import assert_no_request_state
from omnistage.testing.metrics import stage_batch_totals
from tests.serve.conftest import RunningServer

HELLO = [{"role": "user", "content": "Say something nice."}]
SPEECH = {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}
TOKENS = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("omni_stop"), "tiny", seed=0)


@pytest.fixture(scope="module")
def talker_tokens() -> Iterator[list[list[int]]]:
    """The reply tokens each talker request was fed, in order (recorded at stream-done)."""
    fed: list[list[int]] = []

    class RecordingFeed(TalkerFeed):
        def on_done(self):
            fed.append(list(self.tokens))
            return super().on_done()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(omni_stages, "TalkerFeed", RecordingFeed)
        yield fed


@pytest.fixture(scope="module")
def server(checkpoint: Path, talker_tokens) -> Iterator[RunningServer]:
    yield from serve_dummy(checkpoint)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path):
    return Qwen3OmniProcessor.from_checkpoint(checkpoint).tokenizer


@pytest.fixture(scope="module")
def unstopped(client) -> tuple[str, list[str]]:
    """The greedy reply without stop strings, and its first tokens' texts (its first
    streamed pieces: one a token; the random weights never say <|im_end|> in 10 tokens and
    their first tokens are multi-character ``<|unused_N|>`` pieces)."""
    chunks = list(client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=TOKENS, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(len(piece) > 8 for piece in pieces[:3])
    return "".join(pieces), pieces[:3]


def thinker_batches(server: RunningServer) -> float:
    registry = server.app.state.server.metrics.registry
    return stage_batch_totals(registry, "thinker")[0]


def assert_nothing_left(server: RunningServer) -> None:
    pipeline = server.app.state.server.pipeline
    asyncio.run_coroutine_threadsafe(assert_no_request_state(pipeline), pipeline.coordinator.loop).result(30)
    engine = pipeline.host.stages["thinker"].scheduler.engine
    assert engine.kv_blocks.num_free_blocks == engine.kv_blocks.num_blocks  # the thinker's KV is free


def test_a_stop_string_across_two_tokens_ends_the_reply_before_it(server, client, unstopped, tokenizer) -> None:
    full, (first, *_) = unstopped
    start = len(first) - 4  # the stop string begins inside the first token and ends in the second
    stop = full[start : len(first) + 5]
    assert full.index(stop) == start
    before = thinker_batches(server)
    reply = client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=TOKENS, stop=[stop, "never"])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == full[:start]
    assert stop not in choice.message.content
    # the thinker stopped at the second token: a prefill and a decode step, not ten steps
    assert thinker_batches(server) - before <= 3
    # the tokens of the text before it: the first token's start, re-tokenized
    assert reply.usage.completion_tokens == len(tokenizer.encode(full[:start], add_special_tokens=False))
    assert_nothing_left(server)


def test_a_streamed_reply_never_shows_the_stop_text(server, client, unstopped, tokenizer) -> None:
    full, (first, second, third) = unstopped
    stop = second[-6:] + third[:5]  # from token 2 into token 3 (its number: first met there)
    assert full.index(stop) == len(first) + len(second) - 6
    chunks = list(client.chat.completions.create(
        model="qwen3-omni", messages=HELLO, max_tokens=TOKENS, stop=stop, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    text = "".join(deltas)
    assert text == full[: len(first) + len(second) - 6]
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # the first token and the second's start, re-tokenized
    assert chunks[-1].usage.completion_tokens == 1 + len(tokenizer.encode(second[:-6], add_special_tokens=False))
    assert_nothing_left(server)


def test_a_stream_releases_text_as_soon_as_it_cannot_begin_a_stop_string(server, client, unstopped) -> None:
    """``|><|never`` is never met, but every token ends in ``|>``, which could begin it: each
    token's text is held until the next token's shows it does not, then released."""
    full, _ = unstopped
    chunks = list(client.chat.completions.create(
        model="qwen3-omni", messages=HELLO, max_tokens=TOKENS, stop="|><|never", stream=True,
    ))  # fmt: skip
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == full
    assert len(deltas) >= TOKENS - 2  # one piece a token (a byte token may join the next), not all at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert_nothing_left(server)


@pytest.mark.parametrize("cut", [0, 5])
def test_a_stop_string_in_the_first_token_keeps_only_the_text_before_it(client, server, unstopped, cut) -> None:
    full, _ = unstopped
    stop = full[cut : cut + 4]
    assert full.index(stop) == cut
    reply = client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=TOKENS, stop=stop)
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == full[:cut]
    assert_nothing_left(server)


def test_stop_strings_never_met_change_nothing(client, server) -> None:
    plain = client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=TOKENS)
    stopped = client.chat.completions.create(
        model="qwen3-omni", messages=HELLO, max_tokens=TOKENS, stop=["never", "<|unused_x", "|>|>", "ZZ"]
    )
    assert stopped.choices[0].message.content == plain.choices[0].message.content
    assert stopped.choices[0].finish_reason == plain.choices[0].finish_reason == "length"
    assert stopped.usage.model_dump() == plain.usage.model_dump()
    assert_nothing_left(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_spoken_reply_voices_exactly_the_text_before_the_stop(
    client, server, unstopped, tokenizer, talker_tokens, stream
) -> None:
    full, (first, *_) = unstopped
    start = len(first) + 6  # inside the second token
    stop = full[start : start + 8]
    assert full.index(stop) == start
    fed = len(talker_tokens)
    audio = {"voice": "ethan", "format": "pcm16" if stream else "wav"}
    body = {"model": "qwen3-omni", "messages": HELLO, "max_tokens": TOKENS, "stop": stop,
            "modalities": ["text", "audio"], "audio": audio}  # fmt: skip
    if stream:
        chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        content = "".join(d.content or "" for d in deltas)
        transcript = [d.audio.model_dump()["transcript"] for d in deltas if d.audio and "transcript" in d.audio.model_dump()][-1]
        usage = chunks[-1].usage
    else:
        reply = client.chat.completions.create(**body)
        content, transcript, usage = reply.choices[0].message.content, reply.choices[0].message.audio.transcript, reply.usage
        samples, rate = soundfile.read(io.BytesIO(base64.b64decode(reply.choices[0].message.audio.data)))
        assert rate == 24000 and len(samples) > 0
    assert content == full[:start] and transcript == content
    # the talker was fed the tokens of the returned text and nothing past it ...
    (voiced,) = talker_tokens[fed:]
    assert tokenizer.decode(voiced) == content and len(voiced) == usage.completion_tokens_details.text_tokens
    # ... and its frame cap followed them (the random talker never says its EOS)
    assert usage.completion_tokens_details.audio_tokens == talker_frame_cap(len(voiced))
    assert_nothing_left(server)


def test_a_spoken_reply_cut_to_nothing_is_silent(client, server, unstopped, talker_tokens) -> None:
    full, _ = unstopped
    fed = len(talker_tokens)
    reply = client.chat.completions.create(
        model="qwen3-omni", messages=HELLO, max_tokens=TOKENS, stop=full[:3], **SPEECH
    )
    message = reply.choices[0].message
    assert message.content == "" and message.audio.transcript == ""
    samples, _ = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)))
    assert len(samples) == 0 and reply.usage.completion_tokens_details.audio_tokens == 0
    assert reply.choices[0].finish_reason == "stop" and talker_tokens[fed:] == [[]]
    assert_nothing_left(server)


@pytest.mark.parametrize(
    ("stop", "param"),
    [(["a", "b", "c", "d", "e"], "stop"), ("", "stop"), (["a", ""], "stop.1"), (5, "stop"), ([1], "stop"),
     ({"text": "a"}, "stop")],
)  # fmt: skip
def test_bad_stop_values_are_refused_naming_the_field_before_any_stage_runs(client, server, stop, param) -> None:
    before = thinker_batches(server)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=2, stop=stop)
    assert excinfo.value.body["param"] == param and excinfo.value.body["type"] == "invalid_request_error"
    assert thinker_batches(server) == before
    assert_nothing_left(server)
