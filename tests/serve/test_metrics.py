"""ServerMetrics: per-instance registries and the exposed Prometheus text."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnistage.serve.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    """Exposed samples as {(name, sorted labels): value}, parsed from render()."""
    text, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_render_content_type_and_prefix():
    m = ServerMetrics()
    text, content_type = m.render()
    assert content_type.startswith("text/plain")
    lines = text.decode().splitlines()
    names = {line.split()[2] for line in lines if line.startswith("# TYPE")}
    assert names and all(name.startswith("omnistage_") for name in names)
    # prometheus-client also exposes a *_created timestamp per counter/histogram.
    assert {name for name in names if not name.endswith("_created")} == {
        "omnistage_requests_total",
        "omnistage_time_to_first_audio_seconds",
        "omnistage_request_phase_seconds",
        "omnistage_request_latency_seconds",
        "omnistage_real_time_factor",
        "omnistage_requests_in_flight",
        "omnistage_requests_queued",
        "omnistage_stage_queue_depth",
        "omnistage_stage_batch_size",
        "omnistage_stage_batch_seconds",
    }


def test_instances_have_separate_registries():
    a, b = ServerMetrics(), ServerMetrics()
    a.request_started()
    assert samples(a)[("omnistage_requests_in_flight", ())] == 1
    assert samples(b)[("omnistage_requests_in_flight", ())] == 0


def test_request_lifecycle():
    m = ServerMetrics()
    m.request_started()
    m.request_started()
    assert samples(m)[("omnistage_requests_in_flight", ())] == 2
    m.first_audio(0.03)
    m.request_finished(200, "stop", latency_s=2.0, audio_s=4.0)
    m.request_finished(504, None, latency_s=20.0)
    s = samples(m)
    assert s[("omnistage_requests_in_flight", ())] == 0
    ok = ("omnistage_requests_total", (("finish_reason", "stop"), ("status", "200")))
    timeout = ("omnistage_requests_total", (("finish_reason", "none"), ("status", "504")))
    assert s[ok] == 1 and s[timeout] == 1
    assert s[("omnistage_time_to_first_audio_seconds_count", ())] == 1
    assert s[("omnistage_time_to_first_audio_seconds_bucket", (("le", "0.025"),))] == 0
    assert s[("omnistage_time_to_first_audio_seconds_bucket", (("le", "0.05"),))] == 1
    assert s[("omnistage_request_latency_seconds_count", ())] == 2
    assert s[("omnistage_request_latency_seconds_sum", ())] == 22.0
    # RTF is observed only for the request that produced audio: 2 s / 4 s = 0.5.
    assert s[("omnistage_real_time_factor_count", ())] == 1
    assert s[("omnistage_real_time_factor_sum", ())] == 0.5
    assert s[("omnistage_real_time_factor_bucket", (("le", "0.3"),))] == 0
    assert s[("omnistage_real_time_factor_bucket", (("le", "0.5"),))] == 1


def test_rejected_requests_do_not_touch_in_flight():
    m = ServerMetrics()
    m.request_rejected(400)
    m.request_rejected(503)
    s = samples(m)
    assert s[("omnistage_requests_in_flight", ())] == 0
    assert s[("omnistage_requests_total", (("finish_reason", "rejected"), ("status", "400")))] == 1
    assert s[("omnistage_requests_total", (("finish_reason", "rejected"), ("status", "503")))] == 1
    assert s[("omnistage_request_latency_seconds_count", ())] == 0


def test_bucket_ranges():
    text = ServerMetrics().render()[0].decode()
    assert 'omnistage_time_to_first_audio_seconds_bucket{le="0.005"}' in text
    assert 'omnistage_time_to_first_audio_seconds_bucket{le="10.0"}' in text
    assert 'omnistage_real_time_factor_bucket{le="0.01"}' in text
    assert 'omnistage_real_time_factor_bucket{le="10.0"}' in text


def test_queue_gauges_and_batches_per_stage():
    m = ServerMetrics()
    m.set_queued(3)
    m.set_stage_queue_depth("talker", 5)
    m.set_stage_queue_depth("vocoder", 1)
    m.set_stage_queue_depth("talker", 2)
    m.observe_batch("talker", 8, 0.012, "decode")
    m.observe_batch("talker", 3, 0.004, "decode")
    m.observe_batch("talker", 2, 0.030, "mixed")
    m.observe_batch("vocoder", 1, 0.2)
    s = samples(m)
    assert s[("omnistage_requests_queued", ())] == 3
    assert s[("omnistage_stage_queue_depth", (("stage", "talker"),))] == 2
    assert s[("omnistage_stage_queue_depth", (("stage", "vocoder"),))] == 1
    decode, mixed, vocoder = (("kind", "decode"), ("stage", "talker")), (("kind", "mixed"), ("stage", "talker")), (("kind", "batch"), ("stage", "vocoder"))
    assert s[("omnistage_stage_batch_size_bucket", (decode[0], ("le", "4.0"), decode[1]))] == 1
    assert s[("omnistage_stage_batch_size_sum", decode)] == 11
    assert s[("omnistage_stage_batch_size_sum", mixed)] == 2
    assert s[("omnistage_stage_batch_size_count", vocoder)] == 1
    assert s[("omnistage_stage_batch_seconds_sum", decode)] == pytest.approx(0.016)
    assert s[("omnistage_stage_batch_seconds_sum", mixed)] == pytest.approx(0.030)
    assert s[("omnistage_stage_batch_seconds_bucket", (decode[0], ("le", "0.005"), decode[1]))] == 1
    assert s[("omnistage_stage_batch_seconds_bucket", (decode[0], ("le", "0.015"), decode[1]))] == 2
    assert s[("omnistage_stage_batch_seconds_count", vocoder)] == 1


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.first_audio(-0.1),
        lambda m: m.first_audio(math.nan),
        lambda m: m.request_finished(200, "stop", latency_s=-1.0),
        lambda m: m.request_finished(200, "stop", latency_s=1.0, audio_s=math.inf),
        lambda m: m.set_queued(-1),
        lambda m: m.set_stage_queue_depth("s", -1),
        lambda m: m.observe_batch("s", 0, 0.1),
        lambda m: m.observe_batch("s", 1, -0.1),
        lambda m: m.observe_batch("s", 1, math.nan),
    ],
)
def test_bad_observations_raise_and_record_nothing(call):
    m = ServerMetrics()
    m.request_started()
    before = samples(m)
    with pytest.raises(ValueError):
        call(m)
    assert samples(m) == before


def test_first_audio_phases_are_observed_per_phase_and_bad_ones_refused():
    m = ServerMetrics()
    m.first_audio_phases([("admitted", 0.001), ("vocoder.first_output", 0.02)])
    exposed = samples(m)
    assert exposed[("omnistage_request_phase_seconds_sum", (("phase", "admitted"),))] == pytest.approx(0.001)
    assert exposed[("omnistage_request_phase_seconds_count", (("phase", "vocoder.first_output"),))] == 1
    with pytest.raises(ValueError, match="phase first_byte"):
        m.first_audio_phases([("admitted", 0.001), ("first_byte", -1.0)])
    assert samples(m)[("omnistage_request_phase_seconds_count", (("phase", "admitted"),))] == 1
