"""A whole job with distributed.transfer: halved downloads and int8 blockwise delta uploads, decoded by the
aggregator into the same FedAvg the fp32 job computes (within the quantisation bound)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from apiary import keys, streamed_update, streamed_weights
from apiary.weights import loads
from apiary.wire_codec import is_encoded, metadata
from services.aggregator import handlers, wire_decode
from tests.fixtures.embedded import StackFactory, toy_request


async def test_a_bf16_download_int8_delta_job_averages_as_fedavg(embedded: StackFactory, toy_dataset: Path) -> None:
    transfer = {"download": "bf16", "upload": "int8_blockwise", "delta": True, "block_size": 64}
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(toy_request(toy_dataset, num_rounds=2, transfer=transfer))
        view = await stack.wait(job_id, timeout=120)
        stored = await stack.ports.storage.list(keys.job_prefix(job_id))
        rows = await stack.ports.db.fetch(
            "SELECT result_key, size FROM contributions WHERE job_id = $1 AND status = 'accepted'", job_id)
        uploads = [await stack.ports.storage.get_bytes(r["result_key"]) for r in rows if r["result_key"] in stored]
        halved = [k for k in stored if "/wire/" in k]
        downloaded = [loads(await stack.ports.storage.get_bytes(k)) for k in halved]
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))

    assert view["status"] == "completed", view.get("reason")
    assert uploads and all(is_encoded(data) for data in uploads)
    assert all('"int8_blockwise"' in metadata(data)["apiary.update"] for data in uploads)
    assert halved == [] and downloaded == []  # the halved copies went with the job's last round
    # Shard s adds s + 1 each round (5, 4 and 4 samples): the deltas are constant blocks, exact in int8.
    step = (5 * 1 + 4 * 2 + 4 * 3) / 13
    torch.testing.assert_close(final["layer.weight"], torch.full((2, 3), 2 * step), rtol=0, atol=1e-5)
    torch.testing.assert_close(final["layer.bias"], torch.arange(2.0) + 2 * step, rtol=0, atol=1e-5)
    assert final["layer.weight"].dtype == torch.float32


async def test_finished_rounds_contributions_are_deleted_and_the_last_rounds_kept(embedded: StackFactory,
                                                                                  toy_dataset: Path) -> None:
    async with embedded(workers=2) as stack:
        pruned = await stack.submit(toy_request(toy_dataset, num_rounds=3, max_workers=2))
        kept = await stack.submit(toy_request(toy_dataset, num_rounds=3, max_workers=2,
                                              transfer={"keep_contributions": True}))
        views = [await stack.wait(job, timeout=120) for job in (pruned, kept)]
        left = {job: [k for k in await stack.ports.storage.list(keys.job_prefix(job)) if "/shard-" in k
                      and k.endswith(".safetensors")] for job in (pruned, kept)}

    assert [v["status"] for v in views] == ["completed", "completed"]
    assert sorted(left[pruned]) == [keys.contribution(pruned, 3, 1, s) for s in (0, 1)]
    assert len(left[kept]) == 6


async def test_a_job_on_s3_moves_its_large_weights_in_parts(embedded: StackFactory, toy_dataset: Path,
                                                            s3_url: str, s3_server: str) -> None:
    request = toy_request(toy_dataset, num_rounds=2, transfer={"part_size_mib": 5, "download": "bf16"})
    request["entrypoint"] = "tests.toyjobs.big:fl_train_model"
    request["config"] = {"big_mib": 12}
    async with embedded(workers=3, storage_url=s3_url, s3_endpoint_url=s3_server) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=180)
        initial = loads(await stack.ports.storage.get_bytes(keys.global_weights(job_id, 0)))
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))
        client = stack.ports.storage._client  # type: ignore[attr-defined]
        bucket = stack.ports.storage.bucket  # type: ignore[attr-defined]
        contribution = client.head_object(Bucket=bucket,
                                          Key=f"runs/{keys.contribution(job_id, 2, 1, 0)}")
        incomplete = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])

    assert view["status"] == "completed", view.get("reason")
    assert contribution["ETag"].strip('"').endswith("-3")  # 12 MiB in three parts of 5 MiB: a multipart object
    assert incomplete == []
    # Each round starts from the bf16 copy of the global weights; shards add 1/8, 2/8 and 3/8 (5, 4, 4 samples).
    step = (5 * 1 + 4 * 2 + 4 * 3) / 13 / 8
    once = initial["big.weight"].to(torch.bfloat16).float() + step
    twice = once.to(torch.bfloat16).float() + step
    torch.testing.assert_close(final["big.weight"], twice, rtol=0, atol=1e-6)


async def test_large_contributions_fold_straight_from_storage(embedded: StackFactory, toy_dataset: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire_decode, "STREAM_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(streamed_weights, "READ", 1 << 20)
    streamed: list[str] = []
    real = streamed_weights.StreamedWeights.chunks

    def counted(self: streamed_weights.StreamedWeights):  # type: ignore[no-untyped-def]
        streamed.append(self.sha256)
        return real(self)

    monkeypatch.setattr(streamed_weights.StreamedWeights, "chunks", counted)
    request = toy_request(toy_dataset, num_rounds=2)
    request["config"] = {"big_mib": 10}  # over PREFETCH_MAX_BYTES: not prefetched whole
    await _two_plain_steps(embedded, request)

    assert len(streamed) == 6  # every contribution of both rounds


async def test_large_int8_delta_contributions_are_decoded_as_they_fold_from_storage(
        embedded: StackFactory, toy_dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire_decode, "STREAM_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(handlers, "PREFETCH_MAX_BYTES", 1 << 20)
    monkeypatch.setattr(streamed_weights, "READ", 1 << 20)
    decoded: list[int] = []
    real = streamed_update.StreamedUpdate.chunks

    def counted(self: streamed_update.StreamedUpdate):  # type: ignore[no-untyped-def]
        decoded.append(len(self))
        return real(self)

    monkeypatch.setattr(streamed_update.StreamedUpdate, "chunks", counted)
    request = toy_request(toy_dataset, num_rounds=2, transfer={"upload": "int8_blockwise", "delta": True})
    request["config"] = {"big_mib": 10}  # 2.5 MiB in int8: over the (lowered) streaming threshold
    await _two_plain_steps(embedded, request)  # the deltas are constant (1/8, 2/8, 3/8 per round): exact in int8

    assert len(decoded) == 6  # every contribution of both rounds


async def _two_plain_steps(embedded: StackFactory, request: dict[str, Any]) -> None:
    """Run the big toy job (2 rounds, shards of 5, 4 and 4 samples adding 1/8, 2/8 and 3/8) and check it completed
    with the two FedAvg steps exactly."""
    request["entrypoint"] = "tests.toyjobs.big:fl_train_model"
    async with embedded(workers=3) as stack:
        job_id = await stack.submit(request)
        view = await stack.wait(job_id, timeout=180)
        initial = loads(await stack.ports.storage.get_bytes(keys.global_weights(job_id, 0)))
        final = loads(await stack.ports.storage.get_bytes(keys.final_model(job_id)))

    assert view["status"] == "completed", view.get("reason")
    step = (5 * 1 + 4 * 2 + 4 * 3) / 13 / 8
    torch.testing.assert_close(final["big.weight"], initial["big.weight"] + 2 * step, rtol=0, atol=1e-5)
    assert int(final["steps"]) == 2
