"""The suite's peak-RSS sampler (tests/conftest.py) counts each process once."""

from __future__ import annotations

import os
import subprocess
import sys
import weakref

from tests.conftest import tree_rss


def test_a_fork_that_has_not_exec_d_is_not_counted_again_but_a_subprocess_is():
    read_end, write_end = os.pipe()
    forked = os.fork()
    if forked == 0:  # the child: the parent's pages, its command line; waits, then leaves
        os.close(write_end)
        os.read(read_end, 1)
        os._exit(0)
    os.close(read_end)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        counted = tree_rss(os.getpid())
        assert forked not in counted
        assert child.pid in counted and counted[child.pid] > 0
        assert counted[os.getpid()] > 0
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        os.waitpid(forked, 0)
        child.communicate()


def test_free_memory_releases_a_server_that_has_stopped():
    """What the suite does after each module: a stopped server (and so its pipeline and
    weights) is freed, although FastAPI's callable caches held its routes."""
    from fastapi.testclient import TestClient

    from omnistage.serve.app import ServerSettings, create_app
    from omnistage.testing.tone import ToneConfig
    from tests.conftest import free_memory

    app = create_app(ToneConfig.for_model_path("tone-test"), ServerSettings(playground=False, warmup=False))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert client.post("/v1/audio/speech", json={"input": "hi", "response_format": "pcm"}).status_code == 200
    server = weakref.ref(app.state.server)
    del app, client
    free_memory()
    assert server() is None, "the stopped server is still referenced"
