"""``omnistage serve``: resolve the model's pipeline config and serve it with uvicorn."""

from __future__ import annotations

import http.client
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
import uvicorn
from fastapi import FastAPI
from rich.console import Console
from rich.logging import RichHandler

from omnistage.cli.models import EXTRA_MODELS_ENV, ModelArgs, resolve_model
from omnistage.cli.options import API_KEY_ENV, fail, option_group
from omnistage.core.errors import OmnistageError
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.media import DEFAULT_REFERENCE_CACHE_BYTES, MediaPolicy, ReferenceCache
from omnistage.serve.speech_stream import MAX_MESSAGE_CHARS

__all__ = ["SERVE_EPILOG", "HttpImpl", "LoopImpl", "WS_MAX_BYTES", "ServeArgs", "serve", "uvicorn_config"]

READY_POLL_S = 0.2
STARTUP_FAILURE = 3  # uvicorn's exit status when its server did not start
SERVE_EPILOG = (
    "Pipeline overrides: every settable config value is also a flag --<path> VALUE (or "
    "--<path>=VALUE), e.g. --max_concurrent_requests 8, --<stage>.device cuda:0, "
    "--<stage>.factory.args.<knob> 4; values are parsed as YAML scalars. List them all with "
    "'omnistage config resolve --show provenance'.\n\n"
    f"Extra model packages: {EXTRA_MODELS_ENV}=ENTRY[,...] registers more models after the "
    "discovered ones; an ENTRY is a package of model packages (like omnistage.models) or one "
    "SpeechModelConfig class package.module:Class, e.g. "
    f"{EXTRA_MODELS_ENV}=omnistage.testing.tone:ToneConfig with --model-path tone-test."
)


class LogLevel(StrEnum):
    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"


class HttpImpl(StrEnum):
    """uvicorn's HTTP/1.1 parser (``auto``: httptools when installed, else h11)."""

    auto = "auto"
    h11 = "h11"
    httptools = "httptools"


class LoopImpl(StrEnum):
    """uvicorn's event loop (``auto``: uvloop when installed, else asyncio's own)."""

    auto = "auto"
    asyncio = "asyncio"
    uvloop = "uvloop"


# the choices that need a package of their own; the others ship with uvicorn or Python
_PACKAGES: dict[tuple[str, str], str] = {
    ("--http", "httptools"): "httptools",
    ("--loop", "uvloop"): "uvloop",
}


def _check_installed(flag: str, value: str) -> None:
    """Exit with a message now, before loading the model, if ``flag value`` names a package
    that is not installed (uvicorn would fail only once the model is loaded)."""
    package = _PACKAGES.get((flag, value))
    if package is not None and importlib.util.find_spec(package) is None:
        fail(f"{flag} {value}: the {package} package is not installed (pip install {package})")


def _configure_logging(console: Console, level: LogLevel) -> None:
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(uvicorn.config.LOG_LEVELS[level.value])


def _check_address(host: str, port: int) -> None:
    """Exit with a message now, before loading the model, if ``host:port`` cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        fail(f"--host {host!r}: cannot resolve it ({exc.strerror})")
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            fail(f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})")


def _media_domains(values: list[str] | None) -> tuple[str, ...]:
    """The ``--allowed-media-domain`` values; exits on one that is not a bare domain name
    (wildcards included: ``*`` would otherwise match no host at all, and a domain already
    allows its subdomains)."""
    for value in values or ():
        if "*" in value:
            fail(
                f"--allowed-media-domain {value!r}: wildcards are not supported; give a domain "
                "name such as example.com (it also allows its subdomains)"
            )
        if not value.strip(". ") or any(c in value for c in "/:@ "):
            fail(f"--allowed-media-domain {value!r}: give a domain name such as example.com")
    return tuple(values or ())


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/omnistage``, else ``~/.local/share/omnistage`` (the XDG base
    directory default): per user, surviving restarts and upgrades."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "omnistage"


def _served_names(values: list[str] | None) -> tuple[str, ...]:
    """The ``--served-model-name`` values; exits on a blank one."""
    for value in values or ():
        if not value.strip() or value != value.strip():
            fail(f"--served-model-name {value!r}: give a non-empty name without surrounding spaces")
    return tuple(values or ())


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _probe_host(host: str) -> str:
    """Where to reach a server bound to ``host`` from this machine."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _health(host: str, port: int) -> tuple[int, dict]:
    """``GET /health``: (status, JSON body); (0, {}) while the port is closed (stdlib
    client: no proxies, no request logging)."""
    connection = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}
    finally:
        connection.close()


def _wait_ready(
    host: str, port: int, on_ready: Callable[[], None], on_failed: Callable[[str], None], stop: threading.Event
) -> None:
    """Poll ``/health`` until it answers 200 (``on_ready``) or reports a failed start
    (``on_failed`` with the reason); give up on ``stop``."""
    while not stop.wait(READY_POLL_S):
        status, body = _health(host, port)
        if status == 200:
            on_ready()
            return
        if body.get("status") == "failed":
            on_failed(str(body.get("reason")))
            return


class _Stopped(Exception):
    """SIGINT or SIGTERM arrived while uvicorn was not handling signals itself."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped


@contextmanager
def _graceful_signals() -> Iterator[None]:
    """Turn SIGINT/SIGTERM outside uvicorn into :class:`_Stopped`. uvicorn handles them while
    it runs and re-raises them after its graceful shutdown: a clean exit here."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in handled}
    try:
        yield
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_on_fatal(reason: str) -> None:
    """The pipeline gave up (a stage process died past its restart limit): stop uvicorn
    gracefully; :func:`serve` then exits 1 so that a supervisor restarts the server."""
    os.kill(os.getpid(), signal.SIGTERM)


def _run(app: FastAPI, server: ServeArgs, console: Console, what: str) -> None:
    """Run uvicorn, showing a status spinner until ``/health`` answers 200."""
    host, port = server.host, server.port
    url, stop = _url(host, port), threading.Event()
    status = console.status(f"starting {what}: loading weights and warming up")

    def ready() -> None:
        status.stop()
        console.print(f"ready: {url}", highlight=False, markup=False)

    failure: list[str] = []

    def failed(reason: str) -> None:
        failure.append(reason)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn shuts down gracefully

    probe = (_probe_host(host), port, ready, failed, stop)
    watcher = threading.Thread(target=_wait_ready, args=probe, daemon=True)
    status.start()
    watcher.start()
    runner = uvicorn.Server(uvicorn_config(app, server))
    try:
        with _graceful_signals():
            runner.run()
            if not runner.started:  # a failed lifespan startup, logged by uvicorn
                fail("the server did not start (see the log above)", code=STARTUP_FAILURE)
    except SystemExit as exc:  # uvicorn exits when it cannot listen, after logging why
        if exc.code not in (0, None):
            fail("the server did not start (see the log above)", code=_exit_code(exc))
    finally:
        stop.set()
        watcher.join()
        status.stop()
    fatal = app.state.server.pipeline.fatal_error
    if fatal is not None:  # first: the readiness watcher may also have seen /health "failed"
        fail(f"the pipeline gave up: {fatal}", code=1)
    if failure:
        fail(f"the model failed to start: {failure[0]}", code=1)
    console.print("stopped", highlight=False)


def _exit_code(exc: SystemExit) -> int:
    return exc.code if isinstance(exc.code, int) else 1


DEFAULT_SWITCH_INTERVAL_MS = 5.0
"""``--gil-switch-interval-ms``'s default: CPython's own (``sys.getswitchinterval()`` is
0.005 s unless changed)."""

WS_MAX_BYTES = 4 * MAX_MESSAGE_CHARS
"""uvicorn's ``ws_max_size`` (bytes of one WebSocket message): a message the session takes
has at most ``MAX_MESSAGE_CHARS`` characters, each at most 4 bytes of UTF-8, so none is
refused; a larger frame is closed with 1009 from its header instead of being buffered
whole (uvicorn's default is 16 MiB, times its queue of 32 messages)."""


def uvicorn_config(app: FastAPI, server: ServeArgs) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: ``server``'s address, log level (our logging
    stays configured: no ``log_config``), HTTP parser, event loop and the WebSocket
    message cap (:data:`WS_MAX_BYTES`)."""
    return uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level=server.log_level.value,
        log_config=None,
        http=server.http.value,
        loop=server.loop.value,
        ws_max_size=WS_MAX_BYTES,
    )


@dataclass(frozen=True)
class ServeArgs:
    """The server's own options (the model's are :class:`ModelArgs`)."""

    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1"
    port: Annotated[int, typer.Option(help="Port to listen on.", min=1, max=65535)] = 8000
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            help="Require 'Authorization: Bearer KEY' on /v1/*; repeatable (several keys, "
            f"each owning the voices it saves; {API_KEY_ENV} may hold several, space separated).",
            envvar=API_KEY_ENV,
            show_default=False,
        ),
    ] = None
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where saved voices are kept (SQLite database + audio files); "
            "default $XDG_DATA_HOME/omnistage, else ~/.local/share/omnistage.",
            file_okay=False,
            resolve_path=True,
            show_default=False,
        ),
    ] = None
    allowed_local_media_path: Annotated[
        Path | None,
        typer.Option(
            help="Directory media (reference audio; chat images, audio and video) may be read from: file:// URIs and paths under it (off by default).",
            exists=True,
            file_okay=False,
            resolve_path=True,
            show_default=False,
        ),
    ] = None
    allowed_media_domain: Annotated[
        list[str] | None,
        typer.Option(
            help="Domain media URLs (reference audio; chat images, audio and video) may be fetched "
            "from (with its subdomains; no wildcards); repeatable.",
            show_default=False,
        ),
    ] = None
    reference_cache_mib: Annotated[
        int,
        typer.Option(
            help="Decoded voice-clone reference clips kept for reuse, MiB of samples (least "
            "recently used out first; 0: none): a clip sent again skips decoding and "
            "resampling.",
            min=0,
        ),
    ] = DEFAULT_REFERENCE_CACHE_BYTES // (1024 * 1024)
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            help="A name requests may give as 'model' (repeatable; the first is the id in "
            "/v1/models), e.g. a Hugging Face id Qwen/Qwen3-TTS-12Hz-0.6B-Base or an OpenAI "
            "alias tts-1; replaces the model's own names.",
            show_default=False,
        ),
    ] = None
    max_body_bytes: Annotated[
        int,
        typer.Option(
            help="Request body cap in bytes (413 above it); the default fits 10 MiB of "
            "base64 reference audio plus the text.",
            min=1024,
        ),
    ] = ServerSettings.max_body_bytes
    decode_workers: Annotated[
        int,
        typer.Option(
            help="Media decoder worker processes (reference audio, chat images, audio and "
            "video decode in them in parallel); default half the cores, 2 to 8.",
            min=1,
        ),
    ] = MediaPolicy.decode_workers
    log_level: Annotated[LogLevel, typer.Option(help="Server log level.")] = LogLevel.info
    http: Annotated[
        HttpImpl,
        typer.Option(
            help="uvicorn's HTTP parser; auto: httptools when installed, else h11 "
            "(benchmarks/README.md measures both)."
        ),
    ] = HttpImpl.auto
    loop: Annotated[
        LoopImpl,
        typer.Option(help="uvicorn's event loop; auto: uvloop when installed, else asyncio's."),
    ] = LoopImpl.auto
    gil_switch_interval_ms: Annotated[
        float,
        typer.Option(
            help="Python's thread switch interval in ms (sys.setswitchinterval) in the server "
            "process: how long a thread waiting for the GIL lets the holder run before asking "
            "it to let go. Requests pass between its threads (HTTP loop, and the stages placed "
            "in it: their workers, an engine's or vocoder's loop), and each hand-off can wait "
            "this long under load. Stages in processes of their own keep CPython's default.",
            min=0.01,
            max=100.0,
        ),
    ] = DEFAULT_SWITCH_INTERVAL_MS
    no_warmup: Annotated[
        bool, typer.Option("--no-warmup", help="Skip the warm-up request before reporting ready.")
    ] = False
    no_playground: Annotated[
        bool, typer.Option("--no-playground", help="Do not serve the web playground at /.")
    ] = False

    def settings(self) -> ServerSettings:
        media = MediaPolicy(
            self.allowed_local_media_path,
            _media_domains(self.allowed_media_domain),
            decode_workers=self.decode_workers,
            reference_cache=ReferenceCache(self.reference_cache_mib * 1024 * 1024),
        )
        return ServerSettings(
            api_keys=tuple(key for key in self.api_key or () if key),
            data_dir=self.data_dir or default_data_dir(),
            media_policy=media,
            max_body_bytes=self.max_body_bytes,
            warmup=not self.no_warmup,
            playground=not self.no_playground,
            served_model_names=_served_names(self.served_model_name),
        )


@option_group(ModelArgs, "model")
@option_group(ServeArgs, "server")
def serve(ctx: typer.Context, *, model: ModelArgs, server: ServeArgs) -> None:
    """Serve a speech or chat model behind an OpenAI-compatible API (POST /v1/audio/speech,
    POST /v1/chat/completions)."""
    resolved = resolve_model(model, ctx.args)
    _check_address(server.host, server.port)
    _check_installed("--http", server.http.value)
    _check_installed("--loop", server.loop.value)
    settings = server.settings()
    sys.setswitchinterval(server.gil_switch_interval_ms / 1000)
    console = Console(stderr=True)
    _configure_logging(console, server.log_level)
    try:
        app = create_app(resolved.config, settings, on_fatal=_stop_on_fatal)
    except OmnistageError as exc:
        fail(f"invalid pipeline: {exc}")
    _run(app, server, console, resolved.config.name)
