"""One trace per version of an async (FedBuff) job on the embedded stack: the version's round span is the root,
the training tasks handed out while it was open are its children, and its aggregation span (a child too) links
every update it folded, from whichever version's trace that update's task came."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from apiary import telemetry
from tests.fixtures.embedded import StackFactory, toy_request
from tests.integration.test_tracing import _from_sdk

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    telemetry.setup("apiary-test", exporter=spans)
    yield spans
    telemetry.shutdown()


async def test_each_version_is_one_trace_linking_the_updates_it_folded(embedded: StackFactory, toy_dataset: Path,
                                                                       exporter: InMemorySpanExporter) -> None:
    exporter.clear()
    request = toy_request(toy_dataset, num_rounds=4, min_workers=3, max_workers=3, mode="async", evaluate_every=0,
                          **{"async": {"buffer_size": 2}})
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=120)

    spans = _from_sdk(exporter)
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    roots = {s.attributes["apiary.round"]: s for s in spans
             if s.name.startswith("round ") and s.attributes.get("apiary.job_id") == job_id}
    aggregates = [s for s in spans if s.name == "aggregate" and s.attributes.get("apiary.job_id") == job_id]
    tasks = [s for s in spans if s.name.endswith(" process") and s.attributes.get("apiary.task") == "train"
             and s.attributes.get("apiary.job_id") == job_id]

    assert view["status"] == "completed"
    assert sorted(roots) == [1, 2, 3, 4] and all(r.parent_id is None for r in roots.values())
    assert sorted(a.attributes["apiary.round"] for a in aggregates) == [1, 2, 3, 4]
    for aggregate in aggregates:
        root = roots[aggregate.attributes["apiary.round"]]
        assert (aggregate.trace_id, aggregate.parent_id) == (root.trace_id, root.span_id)
        assert len(aggregate.links) == 2 == aggregate.attributes["apiary.contributions"]
        assert all(by_id[link].name.endswith(" process") for link in aggregate.links)
    for task in tasks:  # each task in the trace of the version open when it went out
        root = roots[task.attributes["apiary.round"]]
        assert (task.trace_id, task.parent_id) == (root.trace_id, root.span_id)
