"""The voice library on a tiny random Qwen3-TTS Base server: upload, use, list, delete,
ownership per API key, restart durability, caps, and a saved voice sounding exactly like
the same clip sent inline."""

from __future__ import annotations

import base64
import inspect
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from test_pipeline_http import REF_TEXT, tone_clip, wav_data_uri
from websockets.sync.client import connect

from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.models.qwen3_tts.random_checkpoint import write_random_checkpoint
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.media import MediaPolicy
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health

ALICE, BOB = "alice-key", "bob-key"
CLIP = base64.b64decode(wav_data_uri(tone_clip(1.5)).split(",", 1)[1])  # WAV bytes, 1.5 s


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("base") / "ckpt", "tiny", "base", seed=0)


def start(checkpoint: Path, data_dir: Path, **settings) -> Iterator[RunningServer]:
    config = Qwen3TTSPipelineConfig.for_model_path(str(checkpoint))
    engine = next(stage for stage in config.stages if stage.name == "tts_engine")
    engine.factory.args["kv_cache_bytes"] = 64 << 20  # not RAM / 8: several servers at once
    options = {"api_keys": (ALICE, BOB), "data_dir": data_dir, "playground": False, "warmup": False, **settings}
    for running in run_uvicorn(create_app(config, ServerSettings(**options))):
        assert wait_health(running.base_url).status_code == 200
        yield running


@pytest.fixture(scope="module")
def server(base_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from start(base_checkpoint, tmp_path_factory.mktemp("data"))


def sdk(server: RunningServer, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key)


def upload(server: RunningServer, name: str, key: str = ALICE, clip: bytes = CLIP, **fields) -> httpx.Response:
    files = {"audio_sample": ("clip.wav", clip, "audio/wav")}
    data = {"name": name, "consent": "consent-1", **fields}
    return httpx.post(
        f"{server.base_url}/v1/audio/voices", files=files, data=data, headers=auth(key), timeout=60
    )


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def speak(server: RunningServer, key: str = ALICE, **fields) -> httpx.Response:
    body = {"input": "Hello there.", "seed": 7, "max_new_tokens": 6, "response_format": "pcm", "stream": False, **fields}
    return httpx.post(f"{server.base_url}/v1/audio/speech", json=body, headers=auth(key), timeout=60)


def saved_names(server: RunningServer, key: str) -> list[str]:
    response = httpx.get(f"{server.base_url}/v1/audio/voices", headers=auth(key))
    assert response.status_code == 200
    return [v["name"] for v in response.json()["uploaded_voices"]]


def test_sdk_upload_returns_an_openai_voice_object(server):
    voice = sdk(server).audio.voices.create(
        audio_sample=("clip.wav", CLIP, "audio/wav"), consent="consent-1", name="sdk-voice",
        extra_body={"ref_text": REF_TEXT},
    )
    assert voice.id.startswith("voice_") and voice.name == "sdk-voice"
    assert voice.object == "audio.voice" and voice.type == "audio_sample" and voice.created_at > 0
    listed = httpx.get(f"{server.base_url}/v1/audio/voices", headers=auth(ALICE)).json()
    assert {"id": voice.id, "name": "sdk-voice"}.items() <= listed["uploaded_voices"][0].items()
    assert listed["saved_voices"] is True
    deleted = sdk(server).audio.voices.delete(voice.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (voice.id, True, "audio.voice.deleted")


@pytest.mark.parametrize("ref_text", [REF_TEXT, None])
def test_a_saved_voice_sounds_exactly_like_the_same_clip_inline(server, ref_text):
    """Same seed: the saved voice (ICL with its transcript, x-vector without) gives the
    same bytes as the clip sent as ref_audio."""
    name = f"same-{ref_text is not None}"
    fields = {"ref_text": ref_text} if ref_text else {}
    assert upload(server, name, **fields).status_code == 200
    saved = speak(server, voice=name)
    inline_fields = {"ref_text": ref_text} if ref_text else {"x_vector_only_mode": True}
    inline = speak(server, ref_audio="data:audio/wav;base64," + base64.b64encode(CLIP).decode(), **inline_fields)
    assert saved.status_code == inline.status_code == 200, saved.text
    assert "x-ignored-fields" not in saved.headers  # the voice was used, not ignored
    assert saved.content == inline.content and len(saved.content) == 6 * 1920 * 2
    by_id = speak(server, voice={"id": upload(server, name + "-b", **fields).json()["id"]})
    assert by_id.content == saved.content


def test_a_saved_voice_costs_no_encoding_per_request(server):
    """The encoded prompt is cached by the clip's content: the second use of a saved voice
    runs neither the speech-tokenizer encoder nor the speaker encoder."""
    encoder = reference_encoder(server)
    assert upload(server, "cached", ref_text=REF_TEXT).status_code == 200
    assert speak(server, voice="cached").status_code == 200
    calls = []
    encode = encoder._encode
    encoder._encode = lambda clips: calls.append(len(clips)) or encode(clips)
    try:
        for _ in range(2):
            assert speak(server, voice="cached").status_code == 200
    finally:
        encoder._encode = encode
    assert calls == []


def reference_encoder(server: RunningServer):
    """The reference_encoder stage's ReferenceEncoder (the compute closure's)."""
    compute = inspect.unwrap(server.speech.pipeline.host.stages["reference_encoder"].scheduler.compute)
    cells = dict(zip(compute.__code__.co_freevars, compute.__closure__, strict=True))
    return cells["encoder"].cell_contents


def test_name_clash_is_409_and_names_are_per_key(server):
    assert upload(server, "mine").status_code == 200
    clash = upload(server, "mine")
    assert clash.status_code == 409 and clash.json()["error"]["param"] == "name"
    assert upload(server, "mine", key=BOB).status_code == 200  # Bob's own "mine"


def test_one_key_cannot_see_use_or_delete_another_keys_voice(server):
    voice_id = upload(server, "alice-only", ref_text=REF_TEXT).json()["id"]
    assert "alice-only" in saved_names(server, ALICE)
    assert "alice-only" not in saved_names(server, BOB)
    used = speak(server, BOB, voice="alice-only")  # not Bob's: no reference at all -> 400
    assert used.status_code == 400 and used.json()["error"]["param"] == "ref_audio"
    assert speak(server, BOB, voice={"id": voice_id}).status_code == 400
    for target in ("alice-only", voice_id):
        gone = httpx.delete(f"{server.base_url}/v1/audio/voices/{target}", headers=auth(BOB))
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
    assert speak(server, ALICE, voice="alice-only").status_code == 200
    assert httpx.get(f"{server.base_url}/v1/audio/voices", headers=auth("mallory")).status_code == 401


def test_delete_removes_the_row_and_the_audio(server):
    voice_id = upload(server, "short-lived").json()["id"]
    audio_file = server.speech.library.audio_dir / f"{voice_id}.audio"
    assert audio_file.read_bytes() == CLIP
    assert httpx.delete(f"{server.base_url}/v1/audio/voices/short-lived", headers=auth(ALICE)).status_code == 200
    assert not audio_file.exists() and "short-lived" not in saved_names(server, ALICE)
    again = httpx.delete(f"{server.base_url}/v1/audio/voices/{voice_id}", headers=auth(ALICE))
    assert again.status_code == 404


def test_a_saved_voice_with_its_own_reference_is_400(server):
    assert upload(server, "both").status_code == 200
    response = speak(server, voice="both", ref_audio="data:audio/wav;base64," + base64.b64encode(CLIP).decode())
    assert response.status_code == 400 and response.json()["error"]["param"] == "voice"


def test_a_saved_voice_with_a_ref_text_of_the_request_is_400(server):
    assert upload(server, "own-text", ref_text=REF_TEXT).status_code == 200
    response = speak(server, voice="own-text", ref_text="Other words.")
    assert response.status_code == 400 and response.json()["error"]["param"] == "ref_text"


def test_x_vector_only_mode_clones_a_saved_voice_from_its_embedding(server):
    assert upload(server, "icl-voice", ref_text=REF_TEXT).status_code == 200
    inline = "data:audio/wav;base64," + base64.b64encode(CLIP).decode()
    saved = speak(server, voice="icl-voice", x_vector_only_mode=True)
    assert saved.status_code == 200, saved.text
    assert saved.content == speak(server, ref_audio=inline, x_vector_only_mode=True).content
    assert saved.content != speak(server, voice="icl-voice").content


@pytest.mark.parametrize(
    ("data", "clips", "param"),
    [({"name": "extra", "consent": "c", "foo": "1"}, 1, "foo"),
     ({"name": ["twice", "again"], "consent": "c"}, 1, "name"),
     ({"name": "two-clips", "consent": "c"}, 2, "audio_sample")],
    ids=["unknown", "repeated", "two_clips"],
)
def test_an_unknown_or_repeated_upload_part_is_400_naming_it(server, data, clips, param):
    files = [("audio_sample", ("clip.wav", CLIP, "audio/wav"))] * clips
    response = httpx.post(f"{server.base_url}/v1/audio/voices", files=files, data=data, headers=auth(ALICE))
    assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert response.json()["error"]["param"] in response.json()["error"]["message"]
    names = data["name"] if isinstance(data["name"], list) else [data["name"]]
    assert not set(names) & set(saved_names(server, ALICE))


@pytest.mark.parametrize(
    ("clip", "status"),
    [(b"not audio at all", 400), (base64.b64decode(wav_data_uri(tone_clip(0.2)).split(",", 1)[1]), 400),
     (base64.b64decode(wav_data_uri(tone_clip(31.0, channels=1)).split(",", 1)[1]), 413)],
    ids=["undecodable", "too_short", "longer_than_30_s"],
)
def test_bad_clips_are_refused_before_they_are_stored(server, clip, status):
    before = sorted(p.name for p in server.speech.library.audio_dir.iterdir())
    response = upload(server, f"bad-{status}-{len(clip)}", clip=clip)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == "audio_sample"
    assert sorted(p.name for p in server.speech.library.audio_dir.iterdir()) == before


@pytest.mark.parametrize(
    ("fields", "param"), [({"name": " "}, "name"), ({"consent": ""}, "consent")]
)
def test_name_and_consent_are_required(server, fields, param):
    files = {"audio_sample": ("clip.wav", CLIP, "audio/wav")}
    data = {"name": "x", "consent": "c", **fields}
    response = httpx.post(f"{server.base_url}/v1/audio/voices", files=files, data=data, headers=auth(ALICE))
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_voices_survive_a_restart(base_checkpoint, tmp_path):
    first = start(base_checkpoint, tmp_path)
    running = next(first)
    try:
        assert upload(running, "durable", ref_text=REF_TEXT).status_code == 200
        assert upload(running, "bobs", key=BOB).status_code == 200
        before = speak(running, voice="durable").content
    finally:
        first.close()
    second = start(base_checkpoint, tmp_path)
    running = next(second)
    try:
        assert saved_names(running, ALICE) == ["durable"] and saved_names(running, BOB) == ["bobs"]
        after = speak(running, voice="durable")
        assert after.status_code == 200 and after.content == before
    finally:
        second.close()


def test_upload_size_cap_is_413(base_checkpoint, tmp_path):
    generator = start(base_checkpoint, tmp_path, media_policy=MediaPolicy(max_bytes=len(CLIP) - 1))
    running = next(generator)
    try:
        response = upload(running, "big")
        assert response.status_code == 413 and response.json()["error"]["param"] == "audio_sample"
    finally:
        generator.close()


def test_a_model_that_does_not_clone_has_no_library(tmp_path):
    from tests.serve.conftest import serve

    generator = serve(ServerSettings(data_dir=tmp_path))
    running = next(generator)
    try:
        files = {"audio_sample": ("clip.wav", CLIP, "audio/wav")}
        response = httpx.post(f"{running.base_url}/v1/audio/voices", files=files, data={"name": "n", "consent": "c"})
        assert response.status_code == 400 and "does not clone voices" in response.json()["error"]["message"]
        assert httpx.get(f"{running.base_url}/v1/audio/voices").json()["uploaded_voices"] == []
    finally:
        generator.close()
    assert not np.any([p.name == "voices.sqlite3" for p in tmp_path.iterdir()])


def test_a_saved_voice_speaks_over_the_websocket_as_its_text_arrives(server):
    """Qwen3-TTS over WebSocket: the session is one request of its fields (a saved voice,
    a seed) whose text enters it as it arrives: the same audio word by word as at once,
    and as the whole text over HTTP in streaming text mode (within 1 LSB: the vocoder
    decodes the same codes in chunks of other sizes)."""
    assert upload(server, "ws-voice", ref_text=REF_TEXT).status_code == 200
    url = server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"

    def session(deltas: list[str]) -> tuple[bytes, list[dict]]:
        audio, events = [], []
        with connect(url, additional_headers=auth(ALICE)) as ws:
            config = {"voice": "ws-voice", "seed": 7, "max_new_tokens": 4, "response_format": "pcm"}
            ws.send(json.dumps({"type": "session.config", **config}))
            for delta in [*deltas, None]:
                ws.send(json.dumps({"type": "input.text", "text": delta} if delta else {"type": "input.done"}))
            while not events or events[-1]["type"] not in ("session.done", "error"):
                message = ws.recv(timeout=60)
                audio.append(message) if isinstance(message, bytes) else events.append(json.loads(message))
        return b"".join(audio), events

    whole, events = session(["Hello there. How are you?"])
    by_word, _ = session(["Hello ", "there. ", "How ", "are ", "you?"])
    assert events[0]["type"] == "session.started" and events[0]["ignored_fields"] == [], events[0]  # voice is used
    assert events[-1]["type"] == "session.done" and events[-1]["segments"] == 1, events[-1]
    samples = [np.frombuffer(a, "<i2").astype(np.int32) for a in (whole, by_word)]
    assert len(samples[0]) == len(samples[1]) == 4 * 1920
    assert np.abs(samples[0] - samples[1]).max() <= 1
    http = speak(server, voice="ws-voice", input="Hello there. How are you?", max_new_tokens=4, non_streaming_mode=False)
    assert np.abs(samples[0] - np.frombuffer(http.content, "<i2")).max() <= 1
