"""The ``omnistage`` command line, on the deterministic tone model (registered through
``OMNISTAGE_EXTRA_MODELS``): models table, config resolution, user errors, and one
end-to-end serve + bench run in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from omnistage.cli.bench import parse_extra_fields, spread_option_values
from omnistage.cli.main import app
from omnistage.serve.registry import ModelRegistry
from omnistage.testing.waits import free_port

TONE = "omnistage.testing.tone:ToneConfig"
ENV = {"OMNISTAGE_EXTRA_MODELS": TONE, "COLUMNS": "200"}
runner = CliRunner()


def invoke(*args: str, env: dict[str, str] | None = None):
    return runner.invoke(app, list(args), env={**ENV, **(env or {})})


def resolve(*args: str, env: dict[str, str] | None = None):
    return invoke("config", "resolve", "--model-path", "tone-test", *args, env=env)


def assert_usage_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


# ----------------------------------------------------------------------------- models


def test_models_lists_discovered_and_extra_models():
    result = invoke("models")
    assert result.exit_code == 0, result.output
    assert "ToneGenerator" in result.stdout and "tone-test" in result.stdout
    discovered = ModelRegistry.discover()
    for architecture, entry in discovered.entries.items():  # the Piper voice, when present
        assert architecture in result.stdout
        for name in entry.entry.embedded_models:
            assert name in result.stdout
        if entry.entry.is_default:
            assert f"default: {entry.entry.embedded_models[0]}" in result.stdout


def test_bad_extra_models_entry_is_a_usage_error():
    result = invoke("models", env={"OMNISTAGE_EXTRA_MODELS": "no_such_pkg.mod:Cls"})
    assert_usage_error(result, "OMNISTAGE_EXTRA_MODELS", "no_such_pkg.mod")
    result = invoke("models", env={"OMNISTAGE_EXTRA_MODELS": "omnistage.testing.tone:tone_samples"})
    assert_usage_error(result, "not a SpeechModelConfig subclass")


# ----------------------------------------------------------------------------- config resolve


def test_config_resolve_prints_the_whole_config_as_yaml():
    result = resolve()
    assert result.exit_code == 0, result.output
    data = yaml.safe_load(result.stdout)
    assert data["name"] == "tone" and data["model_path"] == "tone-test"
    assert [s["name"] for s in data["stages"]] == ["tone"]
    assert data["max_concurrent_requests"] == 64


def test_max_concurrent_requests_flag_is_a_cli_override():
    diff = resolve("--max-concurrent-requests", "7", "--show", "diff")
    assert diff.exit_code == 0, diff.output
    assert yaml.safe_load(diff.stdout) == {"max_concurrent_requests": 7}
    assert "64 -> 7 (cli)" in diff.stdout
    provenance = resolve("--max-concurrent-requests", "7", "--show", "provenance")
    assert "max_concurrent_requests = 7  # cli" in provenance.stdout.splitlines()
    assert "tone.device = cpu  # default" in provenance.stdout.splitlines()


def test_yaml_file_then_cli_flags_take_precedence(tmp_path: Path):
    overrides = tmp_path / "over.yaml"
    overrides.write_text(
        "max_concurrent_requests: 5\nrequest_timeout_s: 30\nstages:\n  tone:\n    device: cuda:1\n"
    )
    args = (
        "--config",
        str(overrides),
        "--max-concurrent-requests",
        "9",
        "--request_timeout_s=12.5",
    )
    lines = resolve(*args, "--show", "provenance").stdout.splitlines()
    assert "max_concurrent_requests = 9  # cli" in lines
    assert "request_timeout_s = 12.5  # cli" in lines
    assert f"tone.device = cuda:1  # yaml:{overrides}" in lines
    data = yaml.safe_load(resolve(*args).stdout)
    assert (data["max_concurrent_requests"], data["request_timeout_s"]) == (9, 12.5)
    assert data["stages"][0]["device"] == "cuda:1"


def test_unknown_override_path_exits_2_with_a_hint():
    assert_usage_error(
        resolve("--tone.factory.args.x", "1"), "unknown config path 'tone.factory.args.x'"
    )
    assert_usage_error(resolve("--tone.devic", "cpu"), "did you mean 'tone.device'?")


def test_override_errors_name_the_path():
    assert_usage_error(resolve("--max-concurrent-requests", "0"), "max_concurrent_requests", "cli")
    conflict = resolve("--max-concurrent-requests", "7", "--max_concurrent_requests", "8")
    assert_usage_error(conflict, "two different values")
    assert_usage_error(resolve("--tone.device"), "--tone.device has no value")


def test_unknown_model_path_exits_2_for_config_and_serve(tmp_path: Path):
    missing = str(tmp_path / "no-such-model")
    for command in (("config", "resolve"), ("serve",)):
        result = invoke(*command, "--model-path", missing)
        assert_usage_error(result, "--model-path", "does not exist", "tone-test")
    assert_usage_error(resolve("--variant", "big"), "--variant", "no variant 'big'")


def test_load_format_a_model_does_not_offer_is_a_usage_error():
    result = invoke("serve", "--model-path", "tone-test", "--load-format", "dummy")
    assert_usage_error(result, "--load-format", "ToneGenerator does not take load format 'dummy'")


def test_serve_rejects_bad_options_before_loading():
    assert_usage_error(
        invoke("serve", "--model-path", "tone-test", "--tone.devic", "x"), "did you mean"
    )
    url_not_domain = ("--allowed-media-domain", "https://example.com")
    result = invoke("serve", "--model-path", "tone-test", *url_not_domain)
    assert_usage_error(result, "--allowed-media-domain", "example.com")
    for wildcard in ("*", "*.example.com"):
        result = invoke("serve", "--model-path", "tone-test", "--allowed-media-domain", wildcard)
        assert_usage_error(result, "--allowed-media-domain", "wildcards are not supported")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        result = invoke("serve", "--model-path", "tone-test", "--port", port)
    assert_usage_error(result, f"--port {port}")


# ----------------------------------------------------------------------------- bench


def test_help_texts():
    result = invoke("bench", "speed", "--help")
    assert result.exit_code == 0, result.output
    for option in ("--base-url", "--concurrency", "--no-stream", "--extra", "--output", "--plot"):
        assert option in result.stdout
    serve_help = invoke("serve", "--help")
    assert serve_help.exit_code == 0, serve_help.output
    for text in (
        "--model-path",
        "--max-concurrent-requests",
        "OMNISTAGE_EXTRA_MODELS",
        "OMNISTAGE_API_KEY",
    ):
        assert text in serve_help.stdout
    init_help = invoke("init-random", "--help", env={"COLUMNS": "200"})
    assert init_help.exit_code == 0, init_help.output
    for text in ("Size [default: the model's first].", "Model type, for models with several [default: the first]."):
        assert text in init_help.stdout  # rich markup would eat an unescaped [default: ...]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--concurrency", "1", "4", "16"],
            ["--concurrency", "1", "--concurrency", "4", "--concurrency", "16"],
        ),
        (
            ["--concurrency=2", "3", "--stream"],
            ["--concurrency=2", "--concurrency", "3", "--stream"],
        ),
        (
            ["--concurrency", "1", "--warmup", "0", "5"],
            ["--concurrency", "1", "--warmup", "0", "5"],
        ),
        (["--", "--concurrency", "1", "2"], ["--", "--concurrency", "1", "2"]),
    ],
)
def test_concurrency_takes_several_values(args, expected):
    assert spread_option_values(args, ("--concurrency",)) == expected


def test_bench_speed_against_no_server_reports_failures(tmp_path: Path):
    out = tmp_path / "speed.json"
    args = ("--base-url", f"http://127.0.0.1:{free_port()}", "--warmup", "0", "--limit", "1")
    result = invoke("bench", "speed", *args, "--concurrency", "1", "2", "--output", str(out))
    assert result.exit_code == 1, result.output
    assert "3 of 3 requests failed" in result.stderr and "ConnectError" in result.stdout
    levels = json.loads(out.read_text())["levels"]
    # default requests per level: max(texts, concurrency)
    assert [(s["concurrency"], s["num_failed"]) for s in levels] == [(1, 1), (2, 2)]


def test_extra_fields_are_json_with_a_string_fallback():
    fields = parse_extra_fields(
        ["speed=1.5", "language=English", 'obj={"a": [1, null]}', "flag=true"]
    )
    assert fields == {"speed": 1.5, "language": "English", "obj": {"a": [1, None]}, "flag": True}


def test_bench_usage_errors_exit_2(tmp_path: Path):
    base = ("bench", "speed", "--base-url", "http://127.0.0.1:9", "--warmup", "0")
    assert_usage_error(invoke(*base, "--extra", "novalue"), "--extra 'novalue'")
    assert_usage_error(invoke(*base, "--extra", "input=hi"), "--extra input")
    assert_usage_error(invoke(*base, "--output", str(tmp_path / "nodir" / "o.json")), "--output")
    assert_usage_error(invoke(*base, "--response-format", "wav"), "--no-stream")
    assert_usage_error(invoke(*base, "--client-processes", "2", "--rate", "1"), "--client-processes", "--rate")
    assert_usage_error(invoke(*base, "--client-processes", "0"), "--client-processes")
    bad_list = tmp_path / "meta.lst"
    bad_list.write_text("only|three|fields\n")
    assert_usage_error(invoke(*base, "--meta-lst", str(bad_list)), "--meta-lst", "line 1")
    assert_usage_error(invoke("bench", "wer", "--asr", "whisper"), "--whisper-model-dir")


# ----------------------------------------------------------------------------- end to end


def _omnistage() -> list[str]:
    script = Path(sys.executable).with_name("omnistage")
    return [str(script)] if script.exists() else [sys.executable, "-m", "omnistage.cli"]


def _wait_healthy(server: subprocess.Popen, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=1.0) as client:
        while time.monotonic() < deadline:
            assert server.poll() is None, server.communicate()[1]
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {timeout_s} s")


def test_serve_then_bench_speed_end_to_end(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(ENV)
    port = free_port()
    serve = [*_omnistage(), "serve", "--model-path", "tone-test", "--port", str(port)]
    server = subprocess.Popen(
        [*serve, "--max-concurrent-requests", "4"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_healthy(server, f"http://127.0.0.1:{port}/health")
        out = tmp_path / "out.json"
        bench = [*_omnistage(), "bench", "speed", "--base-url", f"http://127.0.0.1:{port}"]
        levels = ["--concurrency", "1", "--concurrency", "2", "--num-requests", "4"]
        done = subprocess.run(
            [*bench, *levels, "--output", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(out.read_text())
        assert [
            (s["concurrency"], s["num_requests"], s["num_failed"]) for s in report["levels"]
        ] == [
            (1, 4, 0),
            (2, 4, 0),
        ]
        assert "TTS speed" in done.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=30)
    assert server.returncode == 0, stderr
    assert f"ready: http://127.0.0.1:{port}" in stderr
    assert "Traceback" not in stderr and "stopped" in stderr


def _stage_process_of(server: subprocess.Popen) -> int:
    """The pid of the server's one spawned stage process (its multiprocessing child)."""
    children = []
    for task in Path(f"/proc/{server.pid}/task").iterdir():
        children += (task / "children").read_text().split()
    for pid in children:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return int(pid)
    raise AssertionError(f"no stage process among the children {children}")


def test_serve_exits_non_zero_when_a_stage_process_dies_past_its_restart_limit():
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(ENV)
    port = free_port()
    serve = [
        *_omnistage(),
        "serve",
        "--model-path",
        "tone-test",
        "--port",
        str(port),
        "--no-warmup",
        *("--http", "h11", "--loop", "asyncio"),  # the explicit choices; the other tests: auto
    ]
    server = subprocess.Popen(
        [
            *serve,
            "--tone.process",
            "synth",
            "--max_stage_restarts",
            "0",
            "--process_death_timeout_s",
            "0.4",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_healthy(server, f"http://127.0.0.1:{port}/health")
        os.kill(_stage_process_of(server), signal.SIGKILL)
        _, stderr = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 1, stderr
    assert "the pipeline gave up" in stderr and "synth" in stderr


# ----------------------------------------------------------------------------- serve options


def test_serve_options_become_server_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from omnistage.cli.serve import ServeArgs

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    settings = ServeArgs(api_key=["k1", "k2"], served_model_name=["Qwen/Qwen3-TTS-12Hz-0.6B-Base", "tts-1"]).settings()
    assert settings.api_keys == ("k1", "k2")
    assert settings.served_model_names == ("Qwen/Qwen3-TTS-12Hz-0.6B-Base", "tts-1")
    assert settings.data_dir == tmp_path / "omnistage"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert ServeArgs().settings().data_dir == Path.home() / ".local" / "share" / "omnistage"
    assert ServeArgs(data_dir=tmp_path / "d").settings().data_dir == tmp_path / "d"
    assert ServeArgs(decode_workers=6).settings().media_policy.decode_workers == 6


def test_a_blank_served_model_name_is_a_usage_error():
    assert_usage_error(invoke("serve", "--model-path", "tone-test", "--served-model-name", " "), "--served-model-name")


def test_http_and_loop_flags_reach_uvicorns_config():
    from fastapi import FastAPI
    from uvicorn.protocols.http.h11_impl import H11Protocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from omnistage.cli.serve import HttpImpl, LoopImpl, ServeArgs, uvicorn_config

    defaults = uvicorn_config(FastAPI(), ServeArgs())
    assert (defaults.http, defaults.loop) == ("auto", "auto")
    for http, loop, protocol in (
        (HttpImpl.h11, LoopImpl.asyncio, H11Protocol),
        (HttpImpl.httptools, LoopImpl.uvloop, HttpToolsProtocol),
    ):
        config = uvicorn_config(FastAPI(), ServeArgs(port=free_port(), http=http, loop=loop))
        assert (config.http, config.loop) == (http.value, loop.value)
        config.load()
        assert config.http_protocol_class is protocol


def test_the_websocket_message_cap_is_the_sessions_in_utf8_bytes():
    """uvicorn buffered a frame up to its default 16 MiB before the session's
    MAX_MESSAGE_CHARS check; the CLI passes ws_max_size: 4 bytes per character."""
    from fastapi import FastAPI

    from omnistage.cli.serve import ServeArgs, uvicorn_config
    from omnistage.serve.speech_stream import MAX_MESSAGE_CHARS

    assert uvicorn_config(FastAPI(), ServeArgs()).ws_max_size == 4 * MAX_MESSAGE_CHARS


def test_an_oversized_websocket_frame_is_closed_1009_and_the_largest_message_is_read():
    """With the CLI's ws_max_size, a frame over it is closed with 1009 (not buffered and
    then refused by the session, 1008); a message of MAX_MESSAGE_CHARS 4-byte characters
    still reaches the session (its error names the field, 1008)."""
    from fastapi import FastAPI
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from omnistage.cli.serve import ServeArgs, uvicorn_config
    from omnistage.serve.app import ServerSettings, create_app
    from omnistage.serve.speech_stream import MAX_MESSAGE_CHARS
    from omnistage.testing.tone import ToneConfig
    from tests.serve.conftest import run_uvicorn, wait_health

    ws_max_size = uvicorn_config(FastAPI(), ServeArgs()).ws_max_size
    app = create_app(ToneConfig.for_model_path("tone-test"), ServerSettings(playground=False, warmup=False))
    envelope = '{"type": "session.config", "bogus": ""}'
    largest = envelope[:-2] + "\U0001f600" * (MAX_MESSAGE_CHARS - len(envelope)) + envelope[-2:]
    assert len(largest) == MAX_MESSAGE_CHARS and len(largest.encode()) > MAX_MESSAGE_CHARS * 3
    for running in run_uvicorn(app, ws_max_size=ws_max_size):
        assert wait_health(running.base_url).status_code == 200
        url = running.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        with connect(url) as ws:
            ws.send(largest)
            assert json.loads(ws.recv(timeout=10))["error"]["param"] == "bogus"
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd.code == 1008
        with connect(url) as ws:
            ws.send("x" * (4 * MAX_MESSAGE_CHARS + 1))
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd.code == 1009


def test_a_bad_http_or_loop_value_is_a_usage_error_naming_the_flag():
    for flag in ("--http", "--loop"):
        result = invoke("serve", "--model-path", "tone-test", flag, "fast")
        assert_usage_error(result, flag, "'fast'")


@pytest.mark.parametrize(("flag", "package"), [("--http", "httptools"), ("--loop", "uvloop")])
def test_a_choice_whose_package_is_missing_fails_at_start_naming_the_flag(
    flag: str, package: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setitem(sys.modules, package, None)  # what an import sees when it is absent
    result = invoke("serve", "--model-path", "tone-test", "--port", str(free_port()), flag, package)
    assert_usage_error(result, f"{flag} {package}", f"the {package} package is not installed")


def test_gil_switch_interval_is_set_before_the_server_runs(monkeypatch: pytest.MonkeyPatch):
    """``--gil-switch-interval-ms 0.5`` is CPython's switch interval (0.0005 s) when the
    server starts; the default keeps CPython's 5 ms; 0 is refused naming the flag."""
    import omnistage.cli.serve as serve_module

    seen: list[float] = []
    monkeypatch.setattr(serve_module, "_run", lambda *args: seen.append(sys.getswitchinterval()))
    original = sys.getswitchinterval()
    try:
        for given, expected in ((["--gil-switch-interval-ms", "0.5"], 0.0005), ([], 0.005)):
            result = invoke("serve", "--model-path", "tone-test", "--port", str(free_port()), "--no-warmup", *given)
            assert result.exit_code == 0, result.output
            assert seen[-1] == pytest.approx(expected)
    finally:
        sys.setswitchinterval(original)
    assert_usage_error(invoke("serve", "--model-path", "tone-test", "--gil-switch-interval-ms", "0"), "--gil-switch-interval-ms", "0")
