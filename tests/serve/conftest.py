"""A real uvicorn server on a free loopback port, serving the tone test model."""

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from omnistage.serve.app import ServerSettings, create_app
from omnistage.testing.tone import ToneConfig


@dataclass
class RunningServer:
    base_url: str
    app: object
    server: uvicorn.Server

    @property
    def speech(self):
        return self.app.state.server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(settings: ServerSettings, **config_overrides) -> Iterator[RunningServer]:
    config = ToneConfig.for_model_path("tone-test").model_copy(update=config_overrides)
    app = create_app(config, settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    else:
        raise RuntimeError("server did not become healthy")
    yield RunningServer(base_url, app, server)
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def tone_server() -> Iterator[RunningServer]:
    yield from serve(ServerSettings(max_body_bytes=64 * 1024), max_concurrent_requests=4)


@pytest.fixture(scope="module")
def auth_server() -> Iterator[RunningServer]:
    yield from serve(ServerSettings(api_key="sekret"))
