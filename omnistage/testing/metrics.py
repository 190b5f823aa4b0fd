"""Reading a server's own Prometheus registry in tests."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def stage_batch_totals(registry: CollectorRegistry, stage: str) -> tuple[float, float]:
    """``(batches, requests)`` that ``stage`` computed so far, over every batch kind
    (``omnistage_stage_batch_size_count`` and ``_sum``, :mod:`omnistage.serve.metrics`)."""
    totals = {"omnistage_stage_batch_size_count": 0.0, "omnistage_stage_batch_size_sum": 0.0}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in totals and sample.labels.get("stage") == stage:
                totals[sample.name] += sample.value
    return totals["omnistage_stage_batch_size_count"], totals["omnistage_stage_batch_size_sum"]
