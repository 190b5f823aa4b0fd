"""Saved voices: uploaded reference clips a speech request names as ``voice``.

Storage (under the server's ``--data-dir``): one SQLite database ``voices.sqlite3``
(stdlib :mod:`sqlite3`, WAL journal, one row per voice) and one file per voice's audio,
``voices/<id>.audio``, holding the bytes exactly as uploaded. A voice is written file
first (to a temporary name, renamed into place), then its row; deleted row first, then its
file; at start-up files without a row (a crash between the two steps) are removed, so the
two never disagree for a live voice.

Ownership: each voice belongs to the API key that uploaded it (stored as the key's
SHA-256, never the key), and is visible, usable and deletable by that key only. Without
API keys every client is the same owner (``""``).

Names: unique per owner (a clash is :class:`~omnistage.core.errors.ConflictError`, 409);
a request's ``voice`` may give a saved voice's name or its id. A saved voice's loaded clip
(the media policy's reference cache) and its encoded prompt (x-vector, reference codes:
the model's) are cached by the clip's content, so a saved voice used again is neither
decoded nor re-encoded; each request still reads its file and hashes it.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from omnistage.core.errors import (
    AuthenticationError,
    ConflictError,
    NotFoundError,
    RequestValidationError,
)

__all__ = ["MAX_NAME_CHARS", "SavedVoice", "VoiceLibrary", "data_uri", "key_owner", "owner_of"]

MAX_NAME_CHARS = 128
_SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    consent TEXT NOT NULL,
    ref_text TEXT,
    mime_type TEXT NOT NULL,
    file_size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    UNIQUE (owner, name)
)
"""
_COLUMNS = "id, owner, name, consent, ref_text, mime_type, file_size, sha256, created_at"


def data_uri(mime_type: str, data: bytes) -> str:
    """``data:<mime_type>;base64,<data>``: how a saved clip reaches the model's request
    builder, through the same media decoding as a clip sent inline."""
    return f"data:{mime_type};base64,{base64.b64encode(data).decode('ascii')}"


def owner_of(api_key: str | None) -> str:
    """The owner id of requests made with ``api_key``: its SHA-256 (hex), or ``""`` when
    the server has no keys."""
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


def key_owner(api_keys: tuple[str, ...], authorization: str) -> str:
    """The owner id (:func:`owner_of`) of an
    ``Authorization`` header value; ``""`` when the server has no keys.

    Raises:
        AuthenticationError: keys are set and the header names none of them.
    """
    if not api_keys:
        return owner_of(None)
    scheme, _, token = authorization.partition(" ")
    token = token.strip().encode()
    matches = [key for key in api_keys if secrets.compare_digest(token, key.encode())]
    if scheme.lower() != "bearer" or not matches:
        raise AuthenticationError("invalid or missing API key")
    return owner_of(matches[0])


@dataclass(frozen=True)
class SavedVoice:
    """One saved voice (a row of the library).

    Attributes:
        id: ``voice_<24 hex>``, the OpenAI-style id.
        owner: :func:`owner_of` the uploading key.
        name: the name requests use as ``voice``.
        consent: the uploader's consent reference (vLLM-Omni's and OpenAI's field).
        ref_text: transcript of the clip, or None.
        mime_type: the upload's content type.
        file_size: bytes of the stored audio.
        sha256: hex digest of the stored audio.
        created_at: Unix time, seconds.
    """

    id: str
    owner: str
    name: str
    consent: str
    ref_text: str | None
    mime_type: str
    file_size: int
    sha256: str
    created_at: int


class VoiceLibrary:
    """The saved voices under ``data_dir``; thread-safe (one connection, one lock).

    Args:
        data_dir: directory for ``voices.sqlite3`` and ``voices/`` (created if missing).
        max_voices_per_owner: cap on one owner's voices (a further upload is a 400).

    Raises:
        OSError: ``data_dir`` cannot be created or written.
        sqlite3.Error: the database is unreadable.
    """

    def __init__(self, data_dir: Path, max_voices_per_owner: int = 1000) -> None:
        self.audio_dir = data_dir / "voices"
        self.audio_dir.mkdir(parents=True, exist_ok=True)
        self.max_voices_per_owner = max_voices_per_owner
        self._lock = threading.Lock()
        self._db = sqlite3.connect(data_dir / "voices.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        self._remove_orphan_files()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ queries
    def list(self, owner: str) -> list[SavedVoice]:
        """``owner``'s voices, oldest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM voices WHERE owner = ? ORDER BY created_at, name", (owner,)
            ).fetchall()
        return [SavedVoice(*row) for row in rows]

    def find(self, owner: str, name_or_id: str) -> SavedVoice | None:
        """``owner``'s voice named, or with the id, ``name_or_id``; None if it has none."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM voices WHERE owner = ? AND (name = ? OR id = ?) "
                "ORDER BY name = ? DESC LIMIT 1",
                (owner, name_or_id, name_or_id, name_or_id),
            ).fetchone()
        return SavedVoice(*row) if row else None

    def audio(self, voice: SavedVoice) -> bytes:
        """The stored clip's bytes.

        Raises:
            NotFoundError: the file is gone (removed behind the server's back).
        """
        try:
            return self._path(voice.id).read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"the audio of voice {voice.name!r} is missing from the data directory") from None

    # ------------------------------------------------------------------ changes
    def add(self, owner: str, name: str, consent: str, ref_text: str | None, mime_type: str, data: bytes) -> SavedVoice:
        """Store a new voice for ``owner``.

        Raises:
            ConflictError: ``owner`` already has a voice called ``name`` (409).
            RequestValidationError: ``owner`` has ``max_voices_per_owner`` voices already.
        """
        voice = SavedVoice(
            id=f"voice_{secrets.token_hex(12)}",
            owner=owner,
            name=name,
            consent=consent,
            ref_text=ref_text,
            mime_type=mime_type,
            file_size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            created_at=int(time.time()),
        )
        path = self._path(voice.id)
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(path)
        try:
            with self._lock, self._transaction():
                self._check_room(owner, name)
                values = tuple(getattr(voice, column.strip()) for column in _COLUMNS.split(","))
                self._db.execute(f"INSERT INTO voices ({_COLUMNS}) VALUES ({', '.join('?' * len(values))})", values)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return voice

    def delete(self, owner: str, name_or_id: str) -> SavedVoice:
        """Remove ``owner``'s voice named (or with the id) ``name_or_id``.

        Raises:
            NotFoundError: ``owner`` has no such voice (404; another owner's voice is not
                even acknowledged to exist).
        """
        voice = self.find(owner, name_or_id)
        if voice is None:
            raise NotFoundError(f"no saved voice {name_or_id!r}")
        with self._lock:
            self._db.execute("DELETE FROM voices WHERE id = ? AND owner = ?", (voice.id, owner))
        self._path(voice.id).unlink(missing_ok=True)
        return voice

    # ------------------------------------------------------------------ internals
    def _check_room(self, owner: str, name: str) -> None:
        taken = self._db.execute("SELECT 1 FROM voices WHERE owner = ? AND name = ?", (owner, name)).fetchone()
        if taken:
            raise ConflictError(f"a saved voice named {name!r} exists already; delete it first", param="name")
        (count,) = self._db.execute("SELECT COUNT(*) FROM voices WHERE owner = ?", (owner,)).fetchone()
        if count >= self.max_voices_per_owner:
            raise RequestValidationError(
                f"this key has {count} saved voices, the maximum; delete one first", param="name"
            )

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _path(self, voice_id: str) -> Path:
        return self.audio_dir / f"{voice_id}.audio"

    def _remove_orphan_files(self) -> None:
        with self._lock:
            ids = {row[0] for row in self._db.execute("SELECT id FROM voices")}
        for path in self.audio_dir.iterdir():
            if path.suffix == ".partial" or (path.suffix == ".audio" and path.stem not in ids):
                path.unlink(missing_ok=True)
