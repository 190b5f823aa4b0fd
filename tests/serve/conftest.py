"""A real uvicorn server on a free loopback port, serving the tone test model."""

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from omnistage.serve.app import ServerSettings, create_app
from omnistage.testing.leaks import assert_no_request_state
from omnistage.testing.tone import ToneConfig
from omnistage.testing.waits import free_port


@dataclass
class RunningServer:
    base_url: str
    app: object
    server: uvicorn.Server

    @property
    def speech(self):
        return self.app.state.server

    def assert_no_request_state(self, timeout_s: float = 10.0) -> None:
        """:func:`omnistage.testing.leaks.assert_no_request_state` of the served pipeline,
        run on its coordinator's loop."""
        pipeline = self.speech.pipeline
        asyncio.run_coroutine_threadsafe(assert_no_request_state(pipeline), pipeline.coordinator.loop).result(timeout_s)


def run_uvicorn(app, **options) -> Iterator[RunningServer]:
    """Serve ``app`` on a free port in a thread until the generator is closed (``options``:
    more ``uvicorn.Config`` arguments)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        thread.join(10)


def wait_health(base_url: str, timeout_s: float = 60.0) -> httpx.Response:
    """Poll /health until it is no longer "starting"; returns the last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{base_url}/health")
        if response.json().get("status") != "starting" or time.monotonic() > deadline:
            return response
        time.sleep(0.05)


def serve(settings: ServerSettings, **config_overrides) -> Iterator[RunningServer]:
    config = ToneConfig.for_model_path("tone-test").model_copy(update=config_overrides)
    for running in run_uvicorn(create_app(config, settings)):
        assert wait_health(running.base_url).status_code == 200
        yield running


@pytest.fixture(scope="module")
def tone_server() -> Iterator[RunningServer]:
    yield from serve(ServerSettings(max_body_bytes=64 * 1024), max_concurrent_requests=4)


@pytest.fixture(scope="module")
def auth_server() -> Iterator[RunningServer]:
    yield from serve(ServerSettings(api_keys=("sekret",)))
