"""Reference audio loading behind the media policy: forms, caps, path and URL safety."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import soundfile as sf

from omnistage.core.errors import PayloadTooLargeError, RequestValidationError
from omnistage.serve import media
from omnistage.serve.media import MediaPolicy, load_reference_audio, resample

RATE = 16000
PUBLIC_IP = "93.184.216.34"


def tone(seconds: float = 0.5, rate: int = RATE, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def audio_bytes(samples: np.ndarray, rate: int = RATE, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


WAV = audio_bytes(tone())
B64 = base64.b64encode(WAV).decode()


def assert_tone(ref, seconds: float = 0.5, rate: int = RATE) -> None:
    assert ref.sample_rate == rate
    assert ref.samples.dtype == np.float32 and ref.samples.ndim == 1
    assert len(ref.samples) == int(seconds * rate)
    np.testing.assert_allclose(ref.samples, tone(seconds, rate), atol=1e-4)


def rejects(value, policy=MediaPolicy(), *, status=400, param="ref_audio", **kw) -> str:
    """Assert ``value`` is refused with ``status`` naming ``param``; returns the message."""
    error = PayloadTooLargeError if status == 413 else RequestValidationError
    with pytest.raises(error) as err:
        load_reference_audio(value, policy, param, **kw)
    assert err.value.http_status == status and err.value.param == param
    assert param in str(err.value)
    return str(err.value)


# ----------------------------------------------------------------------------- inline audio


def test_base64_and_data_uri_decode():
    assert_tone(load_reference_audio(B64, MediaPolicy()))
    assert_tone(load_reference_audio(f"data:audio/wav;base64,{B64}", MediaPolicy()))
    wrapped = "\n".join(B64[i : i + 76] for i in range(0, len(B64), 76))  # MIME line breaks
    assert_tone(load_reference_audio(f"  data:audio/x-wav;base64,{wrapped}\n", MediaPolicy()))


def test_other_formats_and_stereo_downmix():
    flac = base64.b64encode(audio_bytes(tone(), fmt="FLAC")).decode()
    assert_tone(load_reference_audio(f"data:audio/flac;base64,{flac}", MediaPolicy()))
    stereo = np.stack([np.full(800, 0.5), np.full(800, 0.1)], axis=1).astype(np.float32)
    ref = load_reference_audio(base64.b64encode(audio_bytes(stereo)).decode(), MediaPolicy())
    assert ref.samples.shape == (800,)
    np.testing.assert_allclose(ref.samples, 0.3, atol=1e-4)


@pytest.mark.parametrize(
    ("channels", "fmt"), [(8, "FLAC"), (9, "WAV"), (16, "WAV"), (33, "WAV"), (64, "WAV")]
)
def test_many_channels_downmix_without_crashing(channels, fmt):
    # Regression: more than 8 channels segfaulted the server inside PyAV's planar
    # frame-to-ndarray conversion (a 7.1 FLAC is 8 channels, the edge of that bug).
    levels = np.linspace(0.05, 0.9, channels, dtype=np.float32)
    samples = np.tile(levels, (1600, 1)) * tone(0.1)[:, None]
    ref = load_reference_audio(
        base64.b64encode(audio_bytes(samples, fmt=fmt)).decode(), MediaPolicy()
    )
    assert ref.samples.shape == (1600,)
    expected = samples.mean(axis=1)
    np.testing.assert_allclose(ref.samples, expected, atol=2 * channels / 32768)


@pytest.mark.parametrize(
    "value",
    [
        "data:audio/wav;base64,@@not-base64@@",
        "data:audio/wav;base64,QUJD",  # "ABC": valid base64, not audio
        "bm90IGF1ZGlvIGF0IGFsbA==",  # "not audio at all"
        "data:audio/wav," + B64,  # not marked base64
        "data:text/plain;base64," + B64,
        "data:audio/wav;base64",  # no comma
        "",
        "   ",
    ],
)
def test_garbage_is_refused_naming_the_field(value):
    rejects(value)
    rejects(value, param="speaker_audio")


def test_plain_text_is_read_as_a_path_and_refused_by_default():
    message = rejects("%%% definitely not base64 %%%")
    assert "--allowed-local-media-path" in message


def test_over_size_is_413():
    small = MediaPolicy(max_bytes=len(WAV) - 1)
    assert "limit" in rejects(B64, small, status=413)
    rejects(f"data:audio/wav;base64,{B64}", small, status=413)
    assert_tone(load_reference_audio(B64, MediaPolicy(max_bytes=len(WAV))))


def test_too_long_is_413():
    assert "0.25 s" in rejects(B64, MediaPolicy(max_duration_s=0.25), status=413)
    assert_tone(load_reference_audio(B64, MediaPolicy(max_duration_s=0.5)))


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_samples_are_a_400_naming_the_field(bad):
    """Every decode refuses them (a chat's input_audio and a video's track too, not only a
    voice reference): a float WAV with one NaN made Qwen3-Omni's reply all NaN tokens."""
    samples = tone()
    samples[100] = bad
    buf = io.BytesIO()
    sf.write(buf, samples, RATE, format="WAV", subtype="FLOAT")
    with pytest.raises(RequestValidationError) as err:
        media.decode_audio(buf.getvalue(), MediaPolicy(), "messages.0.content.0.input_audio.data")
    assert err.value.param == "messages.0.content.0.input_audio.data" and "NaN" in str(err.value)
    rejects(base64.b64encode(buf.getvalue()).decode())


def test_resample():
    x = tone(1.0, 22050)
    y = resample(x, 22050, 16000)
    assert y.dtype == np.float32 and len(y) == 16000
    spectrum = np.abs(np.fft.rfft(y))
    assert abs(np.argmax(spectrum) * 16000 / len(y) - 440.0) <= 1.0
    assert resample(x, 22050, 22050) is x
    with pytest.raises(ValueError):
        resample(x, 0, 16000)


# ----------------------------------------------------------------------------- local files


@pytest.fixture
def media_dirs(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "ref.wav").write_bytes(WAV)
    outside = tmp_path / "secret.wav"
    outside.write_bytes(WAV)
    return root, outside, MediaPolicy(allowed_local_media_path=root)


def test_local_path_refused_by_default(media_dirs):
    root, _, _ = media_dirs
    message = rejects(str(root / "ref.wav"))
    assert "local file paths are disabled" in message
    assert "--allowed-local-media-path" in message
    rejects((root / "ref.wav").as_uri())


def test_local_path_allowed_inside_dir(media_dirs):
    root, _, policy = media_dirs
    assert_tone(load_reference_audio(str(root / "ref.wav"), policy))
    assert_tone(load_reference_audio("ref.wav", policy))  # relative to the directory
    assert_tone(load_reference_audio((root / "ref.wav").as_uri(), policy))
    (root / "sub" / "inner.wav").symlink_to(root / "ref.wav")  # a link staying inside
    assert_tone(load_reference_audio("sub/inner.wav", policy))


def test_dot_dot_escape_refused(media_dirs):
    root, outside, policy = media_dirs
    for value in (f"{root}/sub/../../{outside.name}", f"../{outside.name}", "sub/../ref.wav"):
        assert "outside the allowed media directory" in rejects(value, policy)
    rejects(str(outside), policy)


def test_symlink_escape_refused(media_dirs):
    root, outside, policy = media_dirs
    (root / "link.wav").symlink_to(outside)
    (root / "linkdir").symlink_to(outside.parent, target_is_directory=True)
    assert "outside" in rejects(str(root / "link.wav"), policy)
    rejects("linkdir/secret.wav", policy)


def test_missing_file_directory_and_size(media_dirs):
    root, _, policy = media_dirs
    assert "names no readable local file" in rejects("missing.wav", policy)
    # text that is neither base64 nor a file says both, not only "cannot open"
    message = rejects("!!!not base64!!!", policy)
    assert "base64" in message and "local file" in message
    assert "not a regular file" in rejects("sub", policy)
    small = MediaPolicy(allowed_local_media_path=root, max_bytes=100)
    rejects("ref.wav", small, status=413)


def test_a_file_that_grew_after_its_size_was_read_is_read_whole_within_the_cap(media_dirs, monkeypatch):
    """The read takes the size fstat gave plus whatever follows, up to the byte cap."""
    root, _, policy = media_dirs
    fstat = media.os.fstat

    def shrunk(fd):  # as if the file had been 100 bytes when its size was read
        info = fstat(fd)
        return os.stat_result((info.st_mode, info.st_ino, info.st_dev, info.st_nlink, info.st_uid,
                               info.st_gid, 100, info.st_atime, info.st_mtime, info.st_ctime))  # fmt: skip

    monkeypatch.setattr(media.os, "fstat", shrunk)
    assert_tone(load_reference_audio("ref.wav", policy))
    capped = MediaPolicy(allowed_local_media_path=root, max_bytes=len(WAV) - 1)
    rejects("ref.wav", capped, status=413)


def test_a_path_with_a_nul_byte_is_a_400(media_dirs):
    _, _, policy = media_dirs
    assert "NUL" in rejects("ref\x00.wav", policy)
    assert "NUL" in rejects("file:///media/ref%00.wav", policy)


def test_base64_characters_that_are_not_audio_are_a_path(media_dirs):
    # Regression: a path made of base64 characters ("/srv/mediaab") was decoded as inline
    # audio; plain base64 is taken only when it decodes to an audio container.
    root, _, policy = media_dirs
    (root / "sub" / "refs").write_bytes(WAV)
    assert base64.b64decode("sub/refs")  # valid base64, 6 bytes that are not audio
    assert_tone(load_reference_audio("sub/refs", policy))
    assert "local file paths are disabled" in rejects("/srv/mediaab")
    flac = base64.b64encode(audio_bytes(tone(), fmt="FLAC")).decode()
    assert_tone(load_reference_audio(flac, MediaPolicy()))


# ----------------------------------------------------------------------------- URLs


class FakeDNS:
    """Replaces ``socket.getaddrinfo``: ``hosts`` maps a name to its addresses."""

    def __init__(self) -> None:
        self.hosts: dict[str, list[str]] = {}
        self.looked_up: list[str] = []

    def __setitem__(self, host: str, addresses: list[str]) -> None:
        self.hosts[host] = addresses

    def getaddrinfo(self, host, port, *args, **kwargs):
        self.looked_up.append(host)
        if host not in self.hosts:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
            for a in self.hosts[host]
        ]


@pytest.fixture
def dns(monkeypatch) -> FakeDNS:
    fake = FakeDNS()
    monkeypatch.setattr(socket, "getaddrinfo", fake.getaddrinfo)
    return fake


class Server:
    """httpx.MockTransport handler: path -> response; records every request."""

    def __init__(self, routes: dict[str, httpx.Response]):
        self.routes = routes
        self.requests: list[httpx.Request] = []
        self.transport = httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.routes.get(request.url.path, httpx.Response(404))


URL_POLICY = MediaPolicy(allowed_media_domains=("media.example.com",))


@pytest.mark.parametrize("url", ["http://xn--/", "https://xn--.media.example.com/r.wav"])
def test_a_url_with_an_invalid_host_is_a_400(url):
    assert "malformed URL" in rejects(url, URL_POLICY)


@pytest.mark.parametrize("address", [PUBLIC_IP, "2606:2800:220:1:248:1893:25c8:1946"])
def test_url_fetch_pins_the_checked_address(dns, address):
    dns["media.example.com"] = [address]
    server = Server({"/ref.wav": httpx.Response(200, content=WAV)})
    ref = load_reference_audio(
        "https://media.example.com:8443/ref.wav", URL_POLICY, transport=server.transport
    )
    assert_tone(ref)
    (request,) = server.requests
    assert request.url.host == address and request.url.scheme == "https"
    assert request.url.port == 8443
    assert request.headers["host"] == "media.example.com:8443"
    assert request.extensions["sni_hostname"] == "media.example.com"


def test_url_refused_when_fetch_is_off(dns):
    server = Server({})
    message = rejects("https://media.example.com/ref.wav", transport=server.transport)
    assert "URL fetch is disabled" in message and "--allowed-media-domain" in message
    assert not server.requests and not dns.looked_up


def test_url_refused_for_a_domain_not_in_the_list(dns):
    dns["evil.com"] = dns["evilexample.com"] = dns["cdn.media.example.com"] = [PUBLIC_IP]
    server = Server({"/ref.wav": httpx.Response(200, content=WAV)})
    policy = MediaPolicy(allowed_media_domains=("example.com",))
    for url in ("https://evil.com/ref.wav", "https://evilexample.com/ref.wav"):
        assert "not an allowed media domain" in rejects(url, policy, transport=server.transport)
    assert not server.requests and not dns.looked_up
    # a subdomain of an allowed domain is allowed
    ref = load_reference_audio("https://cdn.media.example.com/ref.wav", policy, transport=server.transport)  # fmt: skip
    assert_tone(ref)


@pytest.mark.parametrize(
    "addresses",
    [
        ["127.0.0.1"],
        ["10.1.2.3"],
        ["169.254.169.254"],
        ["192.168.0.10"],
        ["::1"],
        ["::ffff:127.0.0.1"],
        ["fe80::1"],
        ["224.0.0.1"],
        ["0.0.0.0"],
        [PUBLIC_IP, "10.0.0.1"],  # every resolved address is checked
    ],
)
def test_url_refused_for_non_public_addresses(dns, addresses):
    dns["media.example.com"] = addresses
    server = Server({"/ref.wav": httpx.Response(200, content=WAV)})
    message = rejects("http://media.example.com/ref.wav", URL_POLICY, transport=server.transport)
    assert "only public addresses" in message
    assert not server.requests


def test_literal_private_ip_refused_even_when_allowed(dns):
    dns["127.0.0.1"] = ["127.0.0.1"]
    policy = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    rejects("http://127.0.0.1:8080/ref.wav", policy, transport=Server({}).transport)


def test_redirect_to_another_host_refused(dns):
    dns["media.example.com"] = dns["other.example.net"] = [PUBLIC_IP]
    moved = httpx.Response(302, headers={"Location": "https://other.example.net/ref.wav"})
    server = Server({"/ref.wav": moved})
    policy = MediaPolicy(allowed_media_domains=("media.example.com", "other.example.net"))
    message = rejects("https://media.example.com/ref.wav", policy, transport=server.transport)
    assert "only redirects within the same host" in message
    assert [r.url.path for r in server.requests] == ["/ref.wav"]


def test_redirects_within_the_host_are_followed_and_bounded(dns):
    dns["media.example.com"] = [PUBLIC_IP]
    server = Server(
        {
            "/a": httpx.Response(301, headers={"Location": "/b"}),
            "/b": httpx.Response(307, headers={"Location": "https://media.example.com/ref.wav"}),
            "/ref.wav": httpx.Response(200, content=WAV),
            "/loop": httpx.Response(302, headers={"Location": "/loop"}),
            "/down": httpx.Response(302, headers={"Location": "http://media.example.com/ref.wav"}),
        }
    )
    assert_tone(load_reference_audio("https://media.example.com/a", URL_POLICY, transport=server.transport))  # fmt: skip
    assert dns.looked_up == ["media.example.com"] * 3  # re-checked at each hop
    assert "more than 3 redirects" in rejects(
        "https://media.example.com/loop", URL_POLICY, transport=server.transport
    )
    rejects("https://media.example.com/down", URL_POLICY, transport=server.transport)


def test_url_body_is_capped_while_streaming(dns):
    dns["media.example.com"] = [PUBLIC_IP]
    sent: list[int] = []

    def chunks():
        for i in range(1000):
            sent.append(i)
            yield b"\0" * 1024

    policy = MediaPolicy(allowed_media_domains=("media.example.com",), max_bytes=10 * 1024)
    server = Server({"/big": httpx.Response(200, content=chunks())})
    rejects("https://media.example.com/big", policy, status=413, transport=server.transport)
    assert len(sent) <= 12  # stopped right after the cap, not after reading everything
    declared = httpx.Response(200, headers={"Content-Length": str(10**9)}, content=b"")
    server = Server({"/declared": declared})
    rejects("https://media.example.com/declared", policy, status=413, transport=server.transport)


def test_url_total_time_limit(dns):
    dns["media.example.com"] = [PUBLIC_IP]

    def slow():
        for _ in range(50):
            time.sleep(0.05)
            yield b"\0" * 10

    policy = MediaPolicy(allowed_media_domains=("media.example.com",), fetch_timeout_s=0.2)
    server = Server({"/slow": httpx.Response(200, content=slow())})
    started = time.monotonic()
    message = rejects("https://media.example.com/slow", policy, transport=server.transport)
    assert "longer than the limit of 0.2 s" in message
    assert time.monotonic() - started < 1.0


def test_url_http_error_and_bad_urls(dns):
    dns["media.example.com"] = [PUBLIC_IP]
    server = Server({})
    assert "HTTP 404" in rejects("https://media.example.com/none", URL_POLICY, transport=server.transport)  # fmt: skip
    assert "cannot resolve" in rejects(
        "https://x.media.example.com/", URL_POLICY, transport=server.transport
    )
    rejects("https:///nohost", URL_POLICY, transport=server.transport)


def counting_decodes(monkeypatch) -> list[int]:
    """The bytes' sizes of every decode from here on."""
    calls: list[int] = []
    decode = media.decode_audio

    def counting_decode(data, policy, param):
        calls.append(len(data))
        return decode(data, policy, param)

    monkeypatch.setattr(media, "decode_audio", counting_decode)
    return calls


@pytest.mark.parametrize("form", ["base64", "data URI", "path", "file URI"])
def test_a_clip_sent_again_is_loaded_once_and_shared_read_only(monkeypatch, tmp_path, form):
    """The cache is keyed by content: the same clip again returns the same read-only
    samples, resampled, without decoding; a different clip is loaded on its own."""
    clips = {f: audio_bytes(tone(freq=f)) for f in (440.0, 330.0)}
    for f, data in clips.items():
        (tmp_path / f"{f}.wav").write_bytes(data)
    value = {
        "base64": lambda f: base64.b64encode(clips[f]).decode(),
        "data URI": lambda f: "data:audio/wav;base64," + base64.b64encode(clips[f]).decode(),
        "path": lambda f: f"{f}.wav",
        "file URI": lambda f: (tmp_path / f"{f}.wav").as_uri(),
    }[form]
    policy = MediaPolicy(allowed_local_media_path=tmp_path)
    fresh = media.decode_audio(clips[440.0], policy, "ref_audio")  # what a miss computes
    calls = counting_decodes(monkeypatch)
    first = load_reference_audio(value(440.0), policy, sample_rate=24000)
    again = load_reference_audio(value(440.0), policy, sample_rate=24000)
    assert again is first and not first.samples.flags.writeable and len(calls) == 1
    assert first.sample_rate == 24000 and len(first.key) == 64
    np.testing.assert_array_equal(first.samples, resample(fresh.samples, fresh.sample_rate, 24000))
    different = load_reference_audio(value(330.0), policy, sample_rate=24000)
    assert len(calls) == 2 and different.key != first.key
    assert not np.array_equal(different.samples[:8000], first.samples[:8000])
    assert len(policy.reference_cache) == 2


def test_a_file_is_keyed_by_its_bytes_not_its_name(tmp_path):
    """A path names whatever the file holds now: new bytes under the same name are loaded
    anew, and the same bytes under another name are the same entry."""
    policy = MediaPolicy(allowed_local_media_path=tmp_path)
    (tmp_path / "ref.wav").write_bytes(audio_bytes(tone(freq=440.0)))
    first = load_reference_audio("ref.wav", policy)
    (tmp_path / "ref.wav").write_bytes(audio_bytes(tone(freq=330.0)))
    changed = load_reference_audio("ref.wav", policy)
    assert changed.key != first.key
    np.testing.assert_allclose(changed.samples, tone(freq=330.0), atol=1e-4)
    (tmp_path / "copy.wav").write_bytes(audio_bytes(tone(freq=330.0)))
    assert load_reference_audio("copy.wav", policy) is changed
    (tmp_path / "ref.wav").unlink()
    assert "names no readable local file" in rejects("ref.wav", policy)


def test_the_caps_a_clip_was_loaded_under_are_part_of_its_key():
    """A policy sharing the cache with lower caps refuses what a laxer one cached."""
    policy = MediaPolicy()
    load_reference_audio(B64, policy)
    rejects(B64, dataclasses.replace(policy, max_duration_s=0.25), status=413)
    rejects(B64, dataclasses.replace(policy, max_bytes=len(WAV) - 1), status=413)
    assert len(policy.reference_cache) == 1


def test_a_clip_the_check_refuses_is_refused_every_time_and_never_cached(monkeypatch):
    calls = counting_decodes(monkeypatch)
    policy = MediaPolicy()

    def too_quiet(audio, param):
        raise RequestValidationError(f"{param} is too quiet", param=param)

    for _ in range(3):
        assert "speaker_audio is too quiet" in rejects(B64, policy, param="speaker_audio", check=too_quiet)
    assert len(calls) == 3 and len(policy.reference_cache) == 0
    assert_tone(load_reference_audio(B64, policy))  # without the check it loads: another key
    assert len(calls) == 4


def test_undecodable_audio_is_a_400_every_time(monkeypatch):
    calls = counting_decodes(monkeypatch)
    policy = MediaPolicy()
    garbage = base64.b64encode(b"RIFF" + bytes(200)).decode()
    for _ in range(2):
        assert "could not be decoded" in rejects(garbage, policy)
    assert len(calls) == 2 and len(policy.reference_cache) == 0


def cached_clip(seed: int, n: int = 1000) -> media.ReferenceClip:
    samples = np.full(n, seed, dtype=np.float32)
    return media.ReferenceClip(samples, RATE, f"{seed:064x}")


def test_the_cache_is_bounded_by_bytes_least_recently_used_out_first():
    cache = media.ReferenceCache(max_bytes=3 * 4000)  # three clips of 1000 float32
    for seed in (1, 2, 3):
        cache.put(f"{seed:064x}", cached_clip(seed))
    assert cache.get(f"{1:064x}") is not None  # 1 is now the most recent: 2 goes next
    cache.put(f"{4:064x}", cached_clip(4))
    assert [cache.get(f"{s:064x}") is not None for s in (1, 2, 3, 4)] == [True, False, True, True]
    assert cache.nbytes == 3 * 4000 and len(cache) == 3
    cache.put(f"{5:064x}", cached_clip(5, n=4000))  # larger than the whole cache: not kept, nothing dropped
    assert cache.get(f"{5:064x}") is None and len(cache) == 3
    off = media.ReferenceCache(max_bytes=0)
    off.put(f"{1:064x}", cached_clip(1))
    assert len(off) == 0 and off.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        media.ReferenceCache(max_bytes=-1)


def test_the_cache_stays_consistent_under_threads():
    cache = media.ReferenceCache(max_bytes=5 * 4000)
    clips = [cached_clip(seed) for seed in range(12)]

    def work(offset: int) -> None:
        for i in range(300):
            clip = clips[(offset + i) % len(clips)]
            hit = cache.get(clip.key)
            assert hit is None or hit is clip
            cache.put(clip.key, clip)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert len(cache) == 5 and cache.nbytes == 5 * 4000
