"""``bench speed --client-processes``: a closed level's requests split over spawned client
processes, against a real HTTP server on a free loopback port."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from omnistage.bench.dataset import BenchSample
from omnistage.bench.speed import SpeechTarget, SpeedOptions, run_speed, split_closed_loop
from tests.serve.conftest import run_uvicorn

CONCURRENCY = 4
CHUNK = np.full(2400, 1000, dtype="<i2").tobytes()  # 0.1 s at 24 kHz


class _Gate:
    """Holds every streamed response until ``CONCURRENCY`` requests are in flight at once
    (so a split that keeps fewer in flight times out instead of passing), and records the
    most ever in flight and each request's text."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.peak = 0
        self.texts: list[str] = []
        self.full: asyncio.Event | None = None


def _app(gate: _Gate) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/audio/speech")
    async def speech(request: Request) -> StreamingResponse:
        body = await request.json()
        with gate.lock:
            gate.texts.append(body["input"])
            gate.in_flight += 1
            gate.peak = max(gate.peak, gate.in_flight)
            if gate.full is None:
                gate.full = asyncio.Event()
            if gate.in_flight >= CONCURRENCY:
                gate.full.set()
            full = gate.full

        async def chunks():
            try:
                await asyncio.wait_for(full.wait(), timeout=20)
                yield CHUNK
                yield CHUNK
            finally:
                with gate.lock:
                    gate.in_flight -= 1

        return StreamingResponse(chunks(), media_type="audio/pcm", headers={"X-Sample-Rate": "24000"})

    return app


def test_two_client_processes_keep_the_level_in_flight_and_send_each_request_once():
    """Concurrency 4 over 2 client processes, 8 requests of 8 distinct texts: the server sees
    4 requests in flight at once and never more, each text exactly once, and the level
    reports 8 successes of 0.2 s of audio at concurrency 4."""
    gate = _Gate()
    samples = [BenchSample(f"s{i}", f"text number {i}") for i in range(8)]
    for running in run_uvicorn(_app(gate)):
        options = SpeedOptions(
            SpeechTarget(base_url=running.base_url, timeout_s=30),
            concurrencies=(CONCURRENCY,),
            num_requests=8,
            warmup=0,
            show_progress=False,
            client_processes=2,
        )
        report = asyncio.run(run_speed(options, samples))
    (level,) = report.levels
    assert (level.concurrency, level.num_ok, level.num_failed) == (CONCURRENCY, 8, 0)
    assert level.audio_s_total == pytest.approx(8 * 0.2)
    assert gate.peak == CONCURRENCY
    assert sorted(gate.texts) == sorted(s.text for s in samples)


def test_client_processes_are_refused_with_open_loop_rates_or_a_mock_transport():
    target = SpeechTarget(base_url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="client_processes"):
        SpeedOptions(target, concurrencies=(), rates=(2.0,), client_processes=2)
    with pytest.raises(ValueError, match="client_processes"):
        SpeedOptions(target, client_processes=0)
    options = SpeedOptions(target, warmup=0, client_processes=2)
    with pytest.raises(ValueError, match="no transport"):
        asyncio.run(run_speed(options, [BenchSample("s", "x")], transport=object()))


@pytest.mark.parametrize(
    ("requests", "concurrency", "processes", "shares"),
    [(12, 3, 2, [2, 1]), (256, 128, 4, [32] * 4), (256, 128, 3, [43, 43, 42]), (5, 2, 4, [1, 1]), (2, 8, 4, [1, 1]),
     (7, 1, 3, [1])],
)
def test_a_closed_level_is_split_by_slots_and_its_requests_in_proportion(requests, concurrency, processes, shares):
    """Each request goes to exactly one process; the concurrencies are as even as possible
    and sum to what can be in flight; each process's requests are in proportion to its
    concurrency (within one round), so no process runs alone at the end."""
    parts = split_closed_loop(range(requests), concurrency, processes)
    assert [share for _, share in parts] == shares
    assert sorted(i for part, _ in parts for i in part) == list(range(requests))
    rounds = requests / sum(shares)
    for part, share in parts:
        assert abs(len(part) - share * rounds) <= share

