"""Resumable uploads and deleting registered files over the HTTP API, against a running stack with the tracker's
tables on SQLite and on PostgreSQL: a file sent in chunks resumes after a cut at what the tracker holds and is
registered only once complete; a refused file leaves nothing registered; a registered dataset lists the jobs that
use it, and only an admin deletes it, once no unfinished job needs it."""

from __future__ import annotations

import asyncio
import hashlib
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx

from services.tracker.upload_routes import MAX_CHUNK_BYTES
from tests.fixtures.served import Served
from tests.toyjobs.toy import make_dataset

API = "/api/v1"
WORKERS = 0  # a job on a dataset waits, unfinished, for workers that never come


def records(count: int) -> bytes:
    """A JSONL dataset of `count` text records."""
    return b"".join(b'{"text": "record %d of a dataset sent in chunks"}\n' % i for i in range(count))


def toy_zip(tmp_path: Path) -> bytes:
    """The toy dataset (a folder of samples with its manifest) as a zip."""
    folder = make_dataset(tmp_path / "toy", 8)
    target = tmp_path / "toy.zip"
    with zipfile.ZipFile(target, "w") as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(folder).as_posix())
    return target.read_bytes()


async def test_a_cut_off_upload_resumes_where_the_tracker_stopped_and_registers_once_complete(served: Served) -> None:
    # Prepare
    data = records(2000)
    third = len(data) // 3
    async with served.client("submitter") as http:
        started = (await http.post(f"{API}/uploads", json={"kind": "datasets", "filename": "chunked.jsonl",
                                                          "name": "chunked", "size": len(data)})).json()
        upload = f"{API}/uploads/{started['upload_id']}"

        # Execute: a chunk, half of the next (cut off), a chunk at a wrong offset, then resume from what it holds
        await http.put(upload, params={"offset": 0}, content=data[:third])
        await http.put(upload, params={"offset": third}, content=data[third:third + third // 2])
        wrong = await http.put(upload, params={"offset": 2 * third}, content=data[2 * third:])
        early = await http.post(f"{upload}/complete")
        held = (await http.get(upload)).json()["received"]
        listed_before = (await http.get(f"{API}/datasets")).json()
        for offset in range(held, len(data), third):
            await http.put(upload, params={"offset": offset}, content=data[offset:offset + third])
        registered = await http.post(f"{upload}/complete")
        after = await http.get(upload)
        listed = (await http.get(f"{API}/datasets")).json()

    # Assert
    assert started["received"] == 0 and started["chunk_size"] > 0
    assert wrong.status_code == 409 and f"offset {third + third // 2}" in wrong.json()["detail"]
    assert early.status_code == 409
    assert held == third + third // 2
    assert listed_before == []
    assert registered.status_code == 201, registered.text
    info = registered.json()
    assert info["sha256"] == hashlib.sha256(data).hexdigest() and info["num_samples"] == 2000
    assert [d["dataset_id"] for d in listed] == [info["dataset_id"]]
    assert after.status_code == 404


async def test_a_file_that_is_no_dataset_is_refused_with_why_and_nothing_is_registered(served: Served) -> None:
    # Prepare
    data = b"this is not JSON\n"
    async with served.client("submitter") as http:
        started = (await http.post(f"{API}/uploads", json={"kind": "datasets", "filename": "broken.jsonl",
                                                          "name": "broken", "size": len(data)})).json()
        upload = f"{API}/uploads/{started['upload_id']}"
        await http.put(upload, params={"offset": 0}, content=data)

        # Execute
        refused = await http.post(f"{upload}/complete")
        listed = (await http.get(f"{API}/datasets")).json()
        gone = await http.get(upload)

    # Assert
    assert refused.status_code == 422 and "broken.jsonl" in refused.json()["detail"]
    assert listed == [] and gone.status_code == 404


async def test_uploads_need_a_submitter_and_belong_to_their_token(served: Served) -> None:
    # Prepare
    body = {"kind": "models", "filename": "m.safetensors", "name": "m", "size": 10}
    async with served.client("viewer") as viewer, served.client("submitter") as mine, \
            served.client("other") as other, served.client("admin") as admin:
        # Execute
        refused = await viewer.post(f"{API}/uploads", json=body)
        upload = f"{API}/uploads/{(await mine.post(f'{API}/uploads', json=body)).json()['upload_id']}"
        theirs = await other.get(upload)
        seen_by_admin = await admin.get(upload)
        abandoned = await mine.delete(upload)
        after = await mine.get(upload)
        oversized = await mine.post(f"{API}/uploads", json={**body, "filename": "../escape"})

    # Assert
    assert refused.status_code == 403
    assert theirs.status_code == 404 and seen_by_admin.status_code == 200
    assert abandoned.status_code == 204 and after.status_code == 404
    assert oversized.status_code == 422


async def test_a_dataset_lists_its_jobs_and_only_an_admin_deletes_it_once_no_unfinished_job_needs_it(
        served: Served, tmp_path: Path) -> None:
    # Prepare: a job on the dataset that waits for workers (there are none)
    async with served.client("admin") as admin, served.client("submitter") as submitter:
        dataset_id = (await submitter.post(f"{API}/datasets", params={"filename": "toy.zip", "name": "toy"},
                                           content=toy_zip(tmp_path))).json()["dataset_id"]
        request = {"name": "waits", "entrypoint": "tests.toyjobs.toy:fl_train_model", "dataset_id": dataset_id,
                   "config": {"mode": "ok"}, "distributed": {"num_rounds": 1, "min_workers": 1, "max_workers": 1}}
        job_id = (await submitter.post(f"{API}/training-jobs", json=request)).json()["job_id"]
        detail = await _until_used(admin, f"{API}/datasets/{dataset_id}")

        # Execute
        by_submitter = await submitter.delete(f"{API}/datasets/{dataset_id}")
        while_needed = await admin.delete(f"{API}/datasets/{dataset_id}")
        await admin.post(f"{API}/training-jobs/{job_id}/cancel")
        await served.stack.wait(job_id, timeout=30)
        deleted = await admin.delete(f"{API}/datasets/{dataset_id}")
        listed = (await admin.get(f"{API}/datasets")).json()
        missing = await admin.get(f"{API}/datasets/{dataset_id}")
    stored = await served.stack.ports.storage.list(f"datasets/{dataset_id}/")

    # Assert
    assert detail["used_by"] == [{"job_id": job_id, "name": "waits", "status": detail["used_by"][0]["status"]}]
    assert by_submitter.status_code == 403 and "admin" in by_submitter.json()["detail"]
    assert while_needed.status_code == 409 and job_id in while_needed.json()["detail"]
    assert deleted.status_code == 204
    assert listed == [] and missing.status_code == 404 and stored == []


async def _until_used(http: httpx.AsyncClient, url: str, timeout: float = 30) -> dict[str, Any]:
    """The dataset's detail once a job is recorded as using it (the tracker logs the request as it hears it)."""
    deadline = time.monotonic() + timeout
    while not (detail := (await http.get(url)).json())["used_by"]:
        assert time.monotonic() < deadline, detail
        await asyncio.sleep(0.1)
    return dict(detail)


async def test_a_chunk_past_the_chunk_limit_or_the_declared_size_is_refused_and_keeps_nothing(served: Served) -> None:
    # Prepare
    async with served.client("submitter") as http:
        started = (await http.post(f"{API}/uploads", json={"kind": "datasets", "filename": "d.jsonl", "name": "d",
                                                          "size": 10})).json()
        upload = f"{API}/uploads/{started['upload_id']}"

        # Execute
        huge = await http.put(upload, params={"offset": 0}, content=b"x" * (MAX_CHUNK_BYTES + 1))
        past_size = await http.put(upload, params={"offset": 0}, content=b"x" * 11)
        held = (await http.get(upload)).json()["received"]

    # Assert
    assert huge.status_code == 413 and "chunk_size" in huge.json()["detail"]
    assert past_size.status_code == 413 and "declared size of 10 bytes" in past_size.json()["detail"]
    assert held == 0
