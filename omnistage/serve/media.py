"""Load reference audio (voice cloning prompts) from a request, behind a media policy.

A reference is given as one string, read as (first match wins):

1. ``data:audio/<type>;base64,<data>``: inline audio;
2. ``http://...`` / ``https://...``: fetched, only from allowed domains (off by default);
3. ``file://<path>``: a local file, only under the allowed directory (off by default);
4. standard base64 (alphabet ``A-Z a-z 0-9 + /``, padded; ASCII spaces, tabs and line
   breaks between the characters ignored, any other character refused) that decodes
   to a known audio container (WAV, FLAC, Ogg, MP3, MP4/M4A, Matroska/WebM, AIFF, CAF,
   AU, WavPack, TTA, APE, AMR, WMA, ADTS AAC, AC-3; :data:`_AUDIO_MAGIC`): inline audio;
5. anything else: a local path (absolute, or relative to the allowed directory), so a
   path that happens to be made of base64 characters (``/srv/media/a.wav``) is a path.

URL fetches are hardened against server-side request forgery: the host must be an allowed
domain or a subdomain of one; every address it resolves to must be public (no loopback,
private, link-local, multicast, reserved or unspecified address, also inside IPv4-mapped
IPv6); the connection goes to the checked address (TLS still verifies the host name);
redirects are followed by hand, at most 3, only to the same host (never https -> http), with
the checks redone at each hop; the body is streamed with the size cap enforced while
reading, and the whole fetch has a time limit. Proxy environment variables are ignored.

Local paths: never with ``..``; the resolved path (symlinks followed) must lie inside the
allowed directory; only regular files.

Audio is decoded with PyAV (any format FFmpeg reads: wav, flac, mp3, ogg/opus, m4a/aac,
webm, ...) in a decoder worker process (:mod:`omnistage.serve.decoding`: a codec crash or
a decode past ``decode_timeout_s`` is a 400 for this request, never a server crash) and
downmixed to mono by averaging the channels. Nothing falls back silently:
every failure raises :class:`~omnistage.core.errors.RequestValidationError` (HTTP 400), or
:class:`~omnistage.core.errors.PayloadTooLargeError` (413) for the size and duration caps, with
``param`` naming the request field and a message saying what is allowed.

:func:`load_reference_audio` blocks (network, decoding): call it from a worker thread in
async code (``await asyncio.to_thread(load_reference_audio, ...)``).

A loaded reference (:class:`ReferenceClip`: decoded, checked by the caller, resampled to
the caller's rate) is kept in the policy's :class:`ReferenceCache` under its content key
(:func:`load_reference_audio`): a voice sent again (every request of a cloned voice sends
its clip) skips the base64 decoding, the decode, the caller's checks and the resampling,
and pays one SHA-256 of what the request sent. The key is the content, so one user's clip
can never stand in for another's; entries are read-only arrays, at most
the cache's ``max_bytes`` of samples in all. Refused clips are never cached: each time they
are sent they are read and refused again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import os
import re
import socket
import stat
import time
import unicodedata
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx
import numpy as np
import soxr

from omnistage.core.errors import PayloadTooLargeError, RequestValidationError
from omnistage.core.lru import BoundedLRU
from omnistage.serve.decode_jobs import (
    AudioDecodeJob,
    DecodeJob,
    DecodeRefused,
    DecodeReply,
    FrameSampling,
    ImageDecodeJob,
    NotBase64,
    VideoDecodeJob,
)
from omnistage.serve.decoding import DEFAULT_WORKERS, DecoderCrashed, DecoderTimeout, shared_pool

__all__ = [
    "DEFAULT_REFERENCE_CACHE_BYTES",
    "IMAGE_DECODE_BYTES_PER_PIXEL",
    "IMAGE_DECODE_HEADROOM_BYTES",
    "Base64Media",
    "DeclaredFormat",
    "MediaPolicy",
    "ReferenceAudio",
    "ReferenceCache",
    "ReferenceClip",
    "SampledVideo",
    "decode_audio",
    "decode_image",
    "decode_video",
    "load_reference_audio",
    "read_base64",
    "read_base64_source",
    "read_media_url",
    "read_media_url_source",
    "resample",
]

MAX_REDIRECTS: Final = 3
_REDIRECT_STATUS: Final = frozenset({301, 302, 303, 307, 308})
_BASE64: Final = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_DATA_URI_TYPES: Final = ("audio/", "application/octet-stream")
#: Address space an image decode may need per pixel of the image, bytes: Pillow holds
#: decoded pixels in 4 bytes each in every mode up to 16-bit RGBA (which it reads as 8-bit
#: RGBA), so its RGB conversion (4 more) peaks at 8; the decoded pixels are then freed, and
#: the RGB image's bytes (3, made in chunks and joined: 3 + 3) peak at 10 a pixel
#: (:func:`omnistage.serve.decode_worker.decode_image`); 12 with a margin. Measured at the
#: default cap (8192x4096 solid PNGs of 0.27 MB, 2-core CPU host, 2026-12-02; bisecting
#: ``run_job``'s ``memory_bytes`` to 8 MiB): the smallest budget that decodes is 358 MiB
#: for 16-bit RGBA, 16-bit RGB, 16-bit grey+alpha and 8-bit RGBA, 327 MiB for 16-bit grey;
#: the cap's budget, 12 x 32 Mi + 64 MiB = 448 MiB, leaves 90 MiB. (Before, at 256 MiB
#: for every job, a 6000x5000 PNG within the cap was refused and its worker retired.)
IMAGE_DECODE_BYTES_PER_PIXEL: Final = 12
#: Fixed part of an image decode's budget, bytes: the encoded file, zlib's and Pillow's
#: buffers (the 38 MiB the measurement above needs beyond 10 bytes a pixel), and a margin.
IMAGE_DECODE_HEADROOM_BYTES: Final = 64 * 1024 * 1024
DEFAULT_REFERENCE_CACHE_BYTES: Final = 64 * 1024 * 1024
"""Loaded reference samples a server keeps by default: 64 MiB of float32, about 11 min of
24 kHz audio (233 clips of 3 s); one 30 s clip at 24 kHz is 2.75 MiB."""


@dataclass(frozen=True)
class ReferenceAudio:
    """Decoded reference audio: mono float32 ``samples`` [N] in [-1, 1] at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


@dataclass(frozen=True)
class ReferenceClip(ReferenceAudio):
    """A loaded reference (:func:`load_reference_audio`): its ``samples`` are read-only
    (every request of the clip shares them), and ``key`` is its content key: 64 hex digits,
    the SHA-256 of what the request sent (the inline text, else the bytes read) and of how
    it was loaded (caps, rate, check). Equal keys mean equal samples, so a model may key
    what it derives from the clip (an encoded prompt) by it too."""

    key: str


class ReferenceCache(BoundedLRU[str, ReferenceClip]):
    """Loaded reference clips by content key (:attr:`ReferenceClip.key`), least recently
    used out first once their samples pass ``max_bytes`` (a
    :class:`~omnistage.core.lru.BoundedLRU` bounded by ``samples.nbytes``); thread-safe
    (requests are built on worker threads). Two threads that miss the same clip at once
    both load it; the first one stored stays.

    Args:
        max_bytes: samples kept at most, bytes (0: none; a clip larger than this alone is
            not kept, and nothing is dropped for it).

    Raises:
        ValueError: ``max_bytes`` is negative.
    """

    def __init__(self, max_bytes: int = DEFAULT_REFERENCE_CACHE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        super().__init__(max_cost=max_bytes, cost=_clip_bytes)
        self.max_bytes = max_bytes

    @property
    def nbytes(self) -> int:
        """The kept samples, bytes."""
        return self.total_cost


def _clip_bytes(clip: ReferenceClip) -> int:
    return clip.samples.nbytes


@dataclass(frozen=True)
class MediaPolicy:
    """What reference media a server accepts. The defaults accept inline audio only.

    Attributes:
        allowed_local_media_path: directory local files may be read from; None refuses
            local paths.
        allowed_media_domains: domains URLs may be fetched from (each also allows its
            subdomains); empty turns URL fetch off.
        max_bytes: cap on the encoded media size in bytes (default 10 MiB).
        max_duration_s: cap on the decoded duration in seconds (default 60).
        fetch_timeout_s: total time limit of a URL fetch in seconds, redirects included.
        decode_timeout_s: time limit of decoding one item in a decoder worker, seconds.
        decode_memory_bytes: memory one audio or video decode job may allocate in its
            worker, bytes (a 7 MB 64-channel 96 kHz WAV peaks at ~25 MiB); an image job's
            is :attr:`image_decode_memory_bytes`, derived from ``max_image_pixels``.
        max_image_pixels: cap on an image's pixels (width x height), read from its header
            before decoding (32 Mi pixels: 96 MiB as RGB); every image within it decodes
            within its job's memory (:attr:`image_decode_memory_bytes`).
        decode_workers: decoder worker processes that decode in parallel (the process-wide
            pool has at least this many; default
            :data:`~omnistage.serve.decoding.DEFAULT_WORKERS`).
        reference_cache: where :func:`load_reference_audio` keeps loaded clips; each policy
            made without one has its own, of :data:`DEFAULT_REFERENCE_CACHE_BYTES`
            (``omnistage serve --reference-cache-mib``). Not part of the policy's equality.
    """

    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_bytes: int = 10 * 1024 * 1024
    max_duration_s: float = 60.0
    fetch_timeout_s: float = 10.0
    decode_timeout_s: float = 10.0
    decode_memory_bytes: int = 256 * 1024 * 1024
    max_image_pixels: int = 32 * 1024 * 1024
    decode_workers: int = DEFAULT_WORKERS
    reference_cache: ReferenceCache = field(default_factory=ReferenceCache, compare=False, repr=False)

    @property
    def image_decode_memory_bytes(self) -> int:
        """Memory an image decode job may allocate, bytes: ``max_image_pixels`` x
        :data:`IMAGE_DECODE_BYTES_PER_PIXEL` + :data:`IMAGE_DECODE_HEADROOM_BYTES`, or
        ``decode_memory_bytes`` if larger, so an image at the pixel cap always decodes
        (448 MiB at the default 32 Mi pixels)."""
        derived = self.max_image_pixels * IMAGE_DECODE_BYTES_PER_PIXEL + IMAGE_DECODE_HEADROOM_BYTES
        return max(self.decode_memory_bytes, derived)


@dataclass(frozen=True, eq=False)
class Base64Media:
    """A media file a request sent inline, still in base64: ``text`` is its standard padded
    base64 (ASCII spaces, tabs and line breaks removed) as ASCII, ``size`` the bytes it
    decodes to (read from its length and padding, within the policy's size cap).
    :func:`decode_image` and :func:`decode_audio` send it to the decoder worker as it is,
    which decodes it there: in
    the server process the base64 of a 640x480 PNG (1.2 MB) held the GIL 2.2-3.5 ms, every
    other thread of the server (the event loop, the engines) waiting (issue 17)."""

    text: bytes
    size: int
    #: the request's string the base64 came from, and where the base64 starts in it: an
    #: error names the first character there that base64 does not take by its position
    source: str = ""
    offset: int = 0

    def decode(self, param: str) -> bytes:
        """The file's bytes (decoded here, in the server process).

        Raises:
            RequestValidationError: not valid base64, naming ``param``.
        """
        try:
            return base64.b64decode(self.text, validate=True)
        except (binascii.Error, ValueError):
            raise _not_base64(param, self.source, self.offset) from None


@dataclass(frozen=True, eq=False)
class SampledVideo:
    """Frames sampled from a video: ``frames`` ``[T, H, W, 3]`` uint8 RGB; ``fps`` frames
    per second of the sampled sequence."""

    frames: np.ndarray
    fps: float


def load_reference_audio(
    value: str,
    policy: MediaPolicy,
    param: str = "ref_audio",
    *,
    sample_rate: int | None = None,
    check: Callable[[ReferenceAudio, str], None] | None = None,
    transport: httpx.BaseTransport | None = None,
) -> ReferenceClip:
    """Read, decode, check and resample one reference audio item (forms listed in the
    module docstring), or take it from ``policy.reference_cache``.

    The content key is computed first: for an inline clip (a data URI or base64) from the
    request's text as sent, without decoding it; for a file or a URL from the bytes read.
    A clip in the cache is returned as it is (it passed ``check`` when it was loaded);
    otherwise it is decoded, checked, resampled and cached. A refused clip is not cached.

    Args:
        value: the request field's string.
        policy: what the server allows, and its cache.
        param: the request field's name, reported in errors.
        sample_rate: the rate to resample to, Hz (soxr HQ, :func:`resample`); None: the
            file's own rate.
        check: the caller's own rules on the decoded clip, at the file's rate: raises
            (naming ``param``, its second argument) for a clip it refuses. A pure function
            of the samples: its name is part of the key.
        transport: httpx transport for URL fetches (tests, custom networking); default: the
            network.

    Returns:
        Read-only mono float32 samples at ``sample_rate`` (or the file's rate), and the key.

    Raises:
        PayloadTooLargeError: the media exceeds ``policy.max_bytes`` or
            ``policy.max_duration_s``.
        RequestValidationError: anything else: malformed value, source not allowed, fetch or
            read failure, undecodable audio; and whatever ``check`` raises.
    """
    if not isinstance(value, str) or not value.strip():
        raise RequestValidationError(
            f"{param} must be a non-empty string: a data URI, base64 audio, an http(s) URL "
            "or a file path",
            param=param,
        )
    text, cache = value.strip(), policy.reference_cache
    lead = len(value) - len(value.lstrip())  # positions in errors count from the value as sent
    remote = text[:8].lower().startswith(("http://", "https://", "file://"))
    inline_key = None if remote else _content_key(b"inline", text.encode("utf-8", "surrogatepass"), policy, sample_rate, check)
    if inline_key is not None and (cached := cache.get(inline_key)) is not None:
        return cached  # this very text was inline audio when it was loaded: it still is
    data, inline = _read_source(text, policy, param, transport, lead)
    key = inline_key if inline_key is not None and inline else _content_key(b"bytes", data, policy, sample_rate, check)
    if not inline and (cached := cache.get(key)) is not None:
        return cached
    audio = decode_audio(data, policy, param)
    if check is not None:
        check(audio, param)
    rate = audio.sample_rate if sample_rate is None else sample_rate
    samples = resample(audio.samples, audio.sample_rate, rate)
    samples.flags.writeable = False  # shared by every request of this clip
    clip = ReferenceClip(samples, rate, key)
    cache.put(key, clip)
    return clip


def _content_key(
    kind: bytes,
    content: bytes,
    policy: MediaPolicy,
    sample_rate: int | None,
    check: Callable[[ReferenceAudio, str], None] | None,
) -> str:
    """SHA-256 hex of how a clip is loaded (the caps a success depends on, the rate, the
    check's name) and of ``content`` (``kind``: ``b"inline"`` text or ``b"bytes"`` read)."""
    check_name = None if check is None else f"{check.__module__}.{check.__qualname__}"
    how = (kind, policy.max_bytes, policy.max_duration_s, sample_rate, check_name)
    digest = hashlib.sha256(repr(how).encode())
    digest.update(b"\0")
    digest.update(content)
    return digest.hexdigest()


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Resample mono float32 [N] from ``from_rate`` to ``to_rate`` Hz with soxr (HQ).

    Returns float32 [round(N * to_rate / from_rate)]; the input itself when the rates match.

    Raises:
        ValueError: a rate is not positive.
    """
    if from_rate <= 0 or to_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {from_rate} -> {to_rate}")
    x = np.asarray(samples, dtype=np.float32)
    if from_rate == to_rate:
        return x
    return soxr.resample(x, from_rate, to_rate, quality="HQ").astype(np.float32, copy=False)


# ----------------------------------------------------------------------------- sources


def _read_source(text: str, policy: MediaPolicy, param: str, transport, lead: int) -> tuple[bytes, bool]:
    """The bytes ``text`` names (the value sent, less ``lead`` characters of leading
    whitespace), and whether they were inline (a data URI or base64)."""
    lower = text[:8].lower()
    if lower.startswith("data:"):
        return _from_data_uri(text, policy, param, lead=lead).decode(param), True
    if lower.startswith(("http://", "https://")):
        return _fetch_url(text, policy, param, transport), False
    if lower.startswith("file://"):
        return _read_local(_file_uri_path(text, param), policy, param), False
    compact = "".join(text.split())
    if len(compact) % 4 == 0 and _BASE64.fullmatch(compact):
        data = _from_base64(compact, policy, param)
        if _is_audio_container(data):
            if _NOT_BASE64_CHAR.search(text) is not None:  # U+00A0, U+2028: split() dropped them
                raise _not_base64(param, text, lead)
            return data, True
    return _read_local(text, policy, param), False


#: Leading bytes of the audio containers plain base64 may carry: (offset, magic). Other
#: bytes are not taken for audio, so a path made of base64 characters stays a path.
_AUDIO_MAGIC: Final = (
    (0, b"RIFF"), (0, b"RF64"), (0, b"riff"),  # WAV, RF64, Wave64
    (0, b"fLaC"), (0, b"OggS"), (0, b"ID3"), (0, b"FORM"), (0, b".snd"), (0, b"caff"),
    (0, b"wvpk"), (0, b"TTA1"), (0, b"MAC "), (0, b"#!AMR"), (0, b"\x1aE\xdf\xa3"),  # EBML
    (0, b"\x30\x26\xb2\x75\x8e\x66\xcf\x11"),  # ASF (wma)
    (4, b"ftyp"), (4, b"moov"), (4, b"mdat"), (4, b"free"), (4, b"wide"),  # MP4 / MOV
)  # fmt: skip


def _is_audio_container(data: bytes) -> bool:
    """Whether ``data`` starts like a known audio container or a bare MPEG/AAC/AC-3 stream."""
    if any(data[offset : offset + len(magic)] == magic for offset, magic in _AUDIO_MAGIC):
        return True
    frame_sync = len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0  # mp3 / adts
    return frame_sync or data[:2] == b"\x0b\x77"  # AC-3 sync word


def _from_data_uri(
    text: str, policy: MediaPolicy, param: str, media_types: tuple[str, ...] = _DATA_URI_TYPES, lead: int = 0
) -> Base64Media:
    kind = media_types[0].rstrip("/")
    header, comma, payload = text.partition(",")
    params = [p.strip().lower() for p in header[5:].split(";")]
    if not comma or "base64" not in params[1:]:
        raise RequestValidationError(
            f"{param}: malformed data URI; expected data:{kind}/<type>;base64,<data>",
            param=param,
        )
    if not params[0].startswith(media_types):
        raise RequestValidationError(
            f"{param}: data URI media type {params[0]!r} is not {kind}; use {kind}/<type>",
            param=param,
        )
    return _inline_base64(payload, policy, param, lead + len(header) + 1)


def read_media_url(
    value: str,
    policy: MediaPolicy,
    param: str,
    kind: str,
    *,
    transport: httpx.BaseTransport | None = None,
) -> bytes:
    """The bytes a chat media URL names (blocks: network): a ``data:<kind>/...;base64,``
    URI, an http(s) URL under the policy's domains, or a ``file://`` URI under its local
    directory (the rules of the module docstring).

    Args:
        kind: ``"image"`` or ``"video"``: the data URI's media type family.

    Raises:
        PayloadTooLargeError: above ``policy.max_bytes``.
        RequestValidationError: any other failure, naming ``param``.
    """
    source = read_media_url_source(value, policy, param, kind, transport=transport)
    return source.decode(param) if isinstance(source, Base64Media) else source


def read_media_url_source(
    value: str,
    policy: MediaPolicy,
    param: str,
    kind: str,
    *,
    transport: httpx.BaseTransport | None = None,
) -> bytes | Base64Media:
    """:func:`read_media_url`, but a data URI's file stays in base64 (:class:`Base64Media`,
    its size cap checked), for :func:`decode_image` to decode in the decoder worker.

    Raises:
        PayloadTooLargeError: above ``policy.max_bytes``.
        RequestValidationError: any other failure (a data URI's base64 that is not ASCII or
            not of a length of 4k), naming ``param``.
    """
    text = value.strip() if isinstance(value, str) else ""
    lower = text[:8].lower()
    if lower.startswith("data:"):
        lead = len(value) - len(value.lstrip())
        return _from_data_uri(text, policy, param, (f"{kind}/", "application/octet-stream"), lead)
    if lower.startswith(("http://", "https://")):
        return _fetch_url(text, policy, param, transport)
    if lower.startswith("file://"):
        return _read_local(_file_uri_path(text, param), policy, param)
    raise RequestValidationError(
        f"{param} must be a data URI (data:{kind}/<type>;base64,<data>) or an http(s) URL",
        param=param,
    )


def read_base64(value: str, policy: MediaPolicy, param: str) -> bytes:
    """Standard padded base64 (ASCII spaces, tabs and line breaks ignored) -> bytes, the size
    cap enforced.

    Raises:
        PayloadTooLargeError: above ``policy.max_bytes``.
        RequestValidationError: not valid base64, naming ``param``.
    """
    return read_base64_source(value, policy, param).decode(param)


def read_base64_source(value: str, policy: MediaPolicy, param: str) -> Base64Media:
    """Standard padded base64 (ASCII spaces, tabs and line breaks ignored), not decoded yet:
    for :func:`decode_audio` to decode in the decoder worker; the size cap checked from its
    length.

    Raises:
        PayloadTooLargeError: above ``policy.max_bytes``.
        RequestValidationError: a character that is not ASCII (its position named), or not
            of a length of 4k (never valid base64), naming ``param``.
    """
    return _inline_base64(value, policy, param, 0)


#: What inline base64 may hold between its characters, removed before it is decoded: ASCII
#: space, tab and line breaks (MIME wraps base64 in lines of 76 with CRLF). Any other
#: character outside the alphabet (a vertical tab, U+00A0, U+2028, a zero-width space) is
#: refused, naming its position: ``str.split()`` used to drop Unicode whitespace silently.
_BASE64_SPACES: Final = " \t\n\r"
_NOT_BASE64_CHAR: Final = re.compile(r"[^A-Za-z0-9+/= \t\n\r]")
_PADDING_INSIDE: Final = re.compile(r"=[= \t\n\r]*[A-Za-z0-9+/]")


def _compact(text: str, param: str, offset: int) -> str:
    """``text`` without :data:`_BASE64_SPACES`, looked for first: in a 640x480 PNG's base64
    (1.2 MB, none) the look took 0.14 ms holding the GIL (one ``memchr`` per space kind),
    ``"".join(text.split())`` 0.56 ms. Text with a character that is not ASCII is refused
    here (:func:`_not_base64`, ``offset``: where ``text`` starts in the request's string);
    other characters outside the alphabet are refused by the decoding."""
    if not text.isascii():
        raise _not_base64(param, text, offset)
    if not any(c in text for c in _BASE64_SPACES):
        return text
    return text.encode("ascii").translate(None, _BASE64_SPACES.encode()).decode("ascii")


def _from_base64(compact: str, policy: MediaPolicy, param: str) -> bytes:
    return _inline_base64(compact, policy, param, 0).decode(param)


def _inline_base64(text: str, policy: MediaPolicy, param: str, offset: int) -> Base64Media:
    """``text`` (base64, ``offset`` characters into the request's string) checked without
    decoding it: ASCII and its spaces removed (:func:`_compact`), the size cap from its
    length (3 bytes per 4 characters, less the padding), a length of 4k."""
    compact = _compact(text, param, offset)
    if len(compact) // 4 * 3 - 2 > policy.max_bytes:  # refuse before anything else
        _check_size(len(compact) // 4 * 3, policy, param)
    if len(compact) % 4:
        raise _not_base64(param, text, offset)
    padding = 2 if compact.endswith("==") else 1 if compact.endswith("=") else 0
    size = len(compact) // 4 * 3 - padding
    _check_size(size, policy, param)
    return Base64Media(compact.encode("ascii"), size, text, offset)


def _not_base64(param: str, source: str = "", offset: int = 0) -> RequestValidationError:
    """The refusal of base64 that does not decode, naming in ``source`` (the base64 as the
    request sent it, ``offset`` characters into the field's string) the first character
    base64 does not take, or else padding inside it, by its 0-based position in the field."""
    if (bad := _NOT_BASE64_CHAR.search(source)) is not None:
        char = bad.group()
        name = unicodedata.name(char, "a control character" if char.isascii() else "unnamed")
        what = f": character {offset + bad.start()} is U+{ord(char):04X} ({name}), which base64 does not take"
    elif (inside := _PADDING_INSIDE.search(source)) is not None:
        what = f": character {offset + inside.start()} is padding (=) before the end"
    else:
        what = ""
    return RequestValidationError(
        f"{param} is not valid base64{what}; send standard padded base64 (A-Z a-z 0-9 + /, "
        "padded with = to a multiple of 4 characters; spaces, tabs and line breaks between "
        "them are ignored)",
        param=param,
    )


def _check_size(size: int, policy: MediaPolicy, param: str) -> None:
    if size > policy.max_bytes:
        raise PayloadTooLargeError(
            f"{param} is {size} bytes or more; the limit is {policy.max_bytes} bytes",
            param=param,
        )


# ----------------------------------------------------------------------------- local files


def _file_uri_path(text: str, param: str) -> str:
    parsed = urllib.parse.urlparse(text)
    if parsed.netloc not in ("", "localhost"):
        raise RequestValidationError(
            f"{param}: file:// URIs must name a local file (file:///path)", param=param
        )
    return urllib.parse.unquote(parsed.path)


def _read_local(text: str, policy: MediaPolicy, param: str) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise RequestValidationError(
            f"{param} is not a data URI, base64 data or an http(s) URL, and local file "
            "paths are disabled; start the server with --allowed-local-media-path DIR to "
            "allow files under DIR",
            param=param,
        )
    if "\x00" in text:
        raise RequestValidationError(f"{param}: a file path cannot contain a NUL character", param=param)
    path = Path(text)
    real_root = Path(root).resolve()
    real = (path if path.is_absolute() else real_root / path).resolve()  # follows symlinks
    if ".." in path.parts or not real.is_relative_to(real_root):
        raise RequestValidationError(
            f"{param}: local path {text!r} is outside the allowed media directory "
            f"{str(root)!r} (no '..', no symlinks leading out)",
            param=param,
        )
    return _read_regular_file(real, text, policy, param)


def _read_regular_file(real: Path, text: str, policy: MediaPolicy, param: str) -> bytes:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(real, flags)
    except OSError as exc:
        raise RequestValidationError(
            f"{param} is not a data URI, base64 data or an http(s) URL, and it names no "
            f"readable local file ({text!r}: {exc.strerror})",
            param=param,
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise RequestValidationError(
                f"{param}: local path {text!r} is not a regular file", param=param
            )
        _check_size(info.st_size, policy, param)
        with os.fdopen(fd, "rb", closefd=False) as file:
            # at most max_bytes + 1, read as st_size + 1 first: a read of n bytes allocates
            # n at once (10 MiB for a 144 KB clip); more only if the file grew since fstat
            data = file.read(info.st_size + 1)
            if len(data) > info.st_size:
                data += file.read(policy.max_bytes + 1 - len(data))
    finally:
        os.close(fd)
    _check_size(len(data), policy, param)
    return data


# ----------------------------------------------------------------------------- URLs


def _fetch_url(text: str, policy: MediaPolicy, param: str, transport) -> bytes:
    if not policy.allowed_media_domains:
        raise RequestValidationError(
            f"{param}: URL fetch is disabled; send the media as a data URI or base64, or "
            "start the server with --allowed-media-domain DOMAIN",
            param=param,
        )
    url = _parse_url(text, param)
    deadline = time.monotonic() + policy.fetch_timeout_s
    with httpx.Client(transport=transport, trust_env=False, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            data, location = _fetch_once(client, url, policy, param, deadline)
            if data is not None:
                return data
            url = _redirect_target(url, location, param)
    raise RequestValidationError(
        f"{param}: more than {MAX_REDIRECTS} redirects fetching {text}", param=param
    )


def _fetch_once(client: httpx.Client, url: httpx.URL, policy, param, deadline):
    """GET ``url`` pinned to a checked address -> (body, None) or (None, redirect location)."""
    host = _allowed_host(url, policy, param)
    address = _public_address(host, url.port or (443 if url.scheme == "https" else 80), param)
    request = client.build_request(
        "GET",
        url.copy_with(host=address),
        headers={"Host": url.netloc.decode("ascii")},
        extensions={"sni_hostname": host},  # TLS verifies the name, not the address
        timeout=max(deadline - time.monotonic(), 0.001),
    )
    try:
        response = client.send(request, stream=True)
        try:
            if response.status_code in _REDIRECT_STATUS:
                return None, response.headers.get("location", "")
            if response.status_code != 200:
                raise RequestValidationError(
                    f"{param}: fetching {url} failed with HTTP {response.status_code}",
                    param=param,
                )
            return _read_capped(response, policy, param, deadline), None
        finally:
            response.close()
    except httpx.TimeoutException:
        raise _fetch_timeout(policy, param) from None
    except httpx.HTTPError as exc:
        raise RequestValidationError(
            f"{param}: fetching {url} failed: {type(exc).__name__}: {exc}", param=param
        ) from None


def _parse_url(text: str, param: str) -> httpx.URL:
    try:
        url = httpx.URL(text)
        host = url.host  # decodes an IDNA host: raises for a malformed one (xn--)
    except (httpx.InvalidURL, ValueError, TypeError, UnicodeError):  # idna.IDNAError is one
        url, host = None, ""
    if url is None or url.scheme not in ("http", "https") or not host:
        raise RequestValidationError(f"{param}: malformed URL {text!r}", param=param)
    return url


def _allowed_host(url: httpx.URL, policy: MediaPolicy, param: str) -> str:
    """The URL's (IDNA-encoded) host if it is an allowed domain or a subdomain of one."""
    host = url.raw_host.decode("ascii").lower().rstrip(".")
    names = {host, url.host.lower().rstrip(".")}
    for domain in policy.allowed_media_domains:
        allowed = domain.strip().lower().rstrip(".")
        if allowed and any(n == allowed or n.endswith("." + allowed) for n in names):
            return host
    raise RequestValidationError(
        f"{param}: host {url.host!r} is not an allowed media domain; allowed: "
        f"{', '.join(policy.allowed_media_domains)} (and their subdomains)",
        param=param,
    )


def _public_address(host: str, port: int, param: str) -> str:
    """The first address ``host`` resolves to, once all of them are checked public."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise RequestValidationError(
            f"{param}: cannot resolve host {host!r}: {exc}", param=param
        ) from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    for address in addresses:
        if not _is_public(address):
            raise RequestValidationError(
                f"{param}: host {host!r} resolves to {address}, a loopback, private, "
                "link-local, multicast or reserved address; only public addresses are fetched",
                param=param,
            )
    if not addresses:
        raise RequestValidationError(f"{param}: host {host!r} has no address", param=param)
    return str(addresses[0])


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return _is_public(ip.ipv4_mapped)
        if ip.sixtofour is not None and not _is_public(ip.sixtofour):
            return False
    blocked = (
        ip.is_loopback
        or ip.is_private
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )
    return ip.is_global and not blocked


def _redirect_target(url: httpx.URL, location: str, param: str) -> httpx.URL:
    try:
        target = url.join(location) if location else None
        if target is not None and not target.host:  # also decodes its IDNA host
            target = None
    except (httpx.InvalidURL, ValueError, TypeError, UnicodeError):
        target = None
    if target is None:
        raise RequestValidationError(
            f"{param}: {url} answered a redirect without a valid Location", param=param
        )
    if (
        target.host != url.host
        or target.scheme not in ("http", "https")
        or (url.scheme == "https" and target.scheme == "http")
    ):
        raise RequestValidationError(
            f"{param}: {url} redirects to {target}; only redirects within the same host "
            "(and not from https to http) are followed",
            param=param,
        )
    return target


def _read_capped(response: httpx.Response, policy: MediaPolicy, param, deadline) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit():
        _check_size(int(declared), policy, param)
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        _check_size(len(body), policy, param)
        if time.monotonic() > deadline:
            raise _fetch_timeout(policy, param)
    return bytes(body)


def _fetch_timeout(policy: MediaPolicy, param: str) -> RequestValidationError:
    return RequestValidationError(
        f"{param}: fetching the URL took longer than the limit of {policy.fetch_timeout_s} s",
        param=param,
    )


# ----------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class DeclaredFormat:
    """The container a request says an audio file is in (chat's ``input_audio.format``):
    ``param`` names that field, ``name`` is its value, ``containers`` the FFmpeg demuxer
    names (``"wav"``, ``"mp3"``, ...) whose files it stands for."""

    param: str
    name: str
    containers: frozenset[str]


def decode_audio(
    data: bytes | Base64Media,
    policy: MediaPolicy,
    param: str,
    max_duration_s: float | None = None,
    declared: DeclaredFormat | None = None,
) -> ReferenceAudio:
    """Decode the first audio stream of any FFmpeg-readable bytes (an audio file, or a
    video's audio track; or its :class:`Base64Media`, decoded from base64 there too) to mono
    float32 at its own rate, enforcing the duration cap, in a decoder worker process
    (:mod:`omnistage.serve.decoding`).

    Args:
        max_duration_s: the duration cap, seconds (None: ``policy.max_duration_s``).
        declared: the format the request declared for the file, checked strictly against
            the container FFmpeg finds (None: any container).

    Raises:
        PayloadTooLargeError: longer than the duration cap.
        RequestValidationError: not valid base64, no audio stream, no samples, NaN or
            infinite samples (a float file's; a model reading them makes NaN), undecodable,
            or the decoder crashed or ran past ``policy.decode_timeout_s``, naming ``param``;
            a container other than ``declared``'s, naming ``declared.param``.
    """
    raw, encoding = (data.text, "base64") if isinstance(data, Base64Media) else (data, "raw")
    containers = () if declared is None else tuple(sorted(declared.containers))
    job = AudioDecodeJob(raw, policy.max_duration_s if max_duration_s is None else max_duration_s,
                         policy.decode_memory_bytes, encoding, containers)  # fmt: skip
    try:
        reply = _run_job(job, policy, param, _AUDIO_HINT, data)
    except _WrongContainer as wrong:
        raise RequestValidationError(
            f"{declared.param} is {declared.name!r}, but {param} {wrong.reason}; the format must "
            "name the file's container (it is checked strictly): declare the file's own format",
            param=declared.param,
        ) from None
    samples = np.frombuffer(reply.samples, dtype="<f4").astype(np.float32)
    if not np.isfinite(samples).all():
        raise RequestValidationError(f"{param} contains NaN or infinite samples", param=param)
    return ReferenceAudio(samples, reply.sample_rate)


def decode_image(data: bytes | Base64Media, policy: MediaPolicy, param: str) -> np.ndarray:
    """Decode image bytes (any format Pillow reads; or their :class:`Base64Media`, decoded
    from base64 there too) to RGB in a decoder worker process.

    Returns:
        ``[H, W, 3]`` uint8.

    Raises:
        PayloadTooLargeError: more than ``policy.max_image_pixels`` pixels.
        RequestValidationError: not valid base64, undecodable, or the decoder crashed or ran
            past ``policy.decode_timeout_s``, naming ``param``.
    """
    raw, encoding = (data.text, "base64") if isinstance(data, Base64Media) else (data, "raw")
    job = ImageDecodeJob(raw, policy.max_image_pixels, policy.image_decode_memory_bytes, encoding)
    reply = _run_job(job, policy, param, _IMAGE_HINT, data)
    return np.frombuffer(reply.rgb, dtype=np.uint8).reshape(reply.height, reply.width, 3)


def decode_video(data: bytes, policy: MediaPolicy, param: str, sampling: FrameSampling) -> SampledVideo:
    """Decode a video's first video stream (any container/codec FFmpeg reads) and sample its
    frames (:class:`~.decode_jobs.FrameSampling`) in a decoder worker process; frames
    are capped at ``policy.max_image_pixels`` pixels each.

    Raises:
        PayloadTooLargeError: more frames than ``sampling.max_frames_decoded``, longer than
            ``sampling.max_duration_s``, or frames above the pixel cap.
        RequestValidationError: no video stream, no frame rate, fewer frames than
            ``frame_factor``, undecodable, over ``policy.decode_memory_bytes``, or the
            decoder crashed or ran past ``policy.decode_timeout_s``, naming ``param``.
    """
    job = VideoDecodeJob(data, sampling, policy.max_image_pixels, policy.decode_memory_bytes)
    reply = _run_job(job, policy, param, _VIDEO_HINT)
    frames = np.frombuffer(reply.frames, dtype=np.uint8).reshape(reply.count, reply.height, reply.width, 3)
    return SampledVideo(frames, reply.fps)


_AUDIO_HINT = ("audio", "send wav, flac, mp3, ogg/opus, m4a or another common audio format")
_IMAGE_HINT = ("an image", "send png, jpeg, webp, gif or another common image format")
_VIDEO_HINT = ("video", "send mp4, webm, mkv or another common video format")


def _run_job(
    job: DecodeJob, policy: MediaPolicy, param: str, hint: tuple[str, str], data: bytes | Base64Media = b""
) -> DecodeReply:
    """Run ``job`` in the shared pool -> its decoded reply (never a refusal); ``data``: what
    the job was made of (a :class:`Base64Media`'s source names a bad character's position)."""
    try:
        reply = shared_pool(policy.decode_workers).run(job, policy.decode_timeout_s)
    except DecoderTimeout:
        raise _undecodable(param, f"decoding took longer than {policy.decode_timeout_s:g} s", hint) from None
    except DecoderCrashed as exc:
        raise _undecodable(param, f"the decoder process crashed: {exc}", hint) from None
    if isinstance(reply, NotBase64):
        raise _not_base64(param, data.source, data.offset) if isinstance(data, Base64Media) else _not_base64(param)
    if isinstance(reply, DecodeRefused):
        if reply.container:
            raise _WrongContainer(reply.reason)
        if reply.too_large:
            raise PayloadTooLargeError(f"{param} {reply.reason}", param=param)
        raise _undecodable(param, reply.reason, hint)
    return reply


class _WrongContainer(Exception):
    """A job's file is in none of its ``containers`` (``reason``: which one it is in)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _undecodable(param: str, why: str, hint: tuple[str, str] = _AUDIO_HINT) -> RequestValidationError:
    what, formats = hint
    return RequestValidationError(f"{param} could not be decoded as {what} ({why}); {formats}", param=param)
