"""The registries through the tracker's API, with its id tables on SQLite and on PostgreSQL: integer ids
allocated atomically and kept across a restart, records in storage, and requests naming unknown ids."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
import zipfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from apiary.bus.memory import MemoryBus
from apiary.db.base import Database
from apiary.db.postgres import PostgresDatabase
from apiary.db.sqlite import SqliteDatabase
from apiary.registry import dataset_info, model_info
from apiary.settings import Settings
from apiary.storage.local import LocalStorage
from services.tracker import Tracker
from services.tracker.client import TrackerClient, TrackerError
from services.tracker.inprocess import in_process_client

DatabaseFactory = Callable[[], Database]


@pytest.fixture(params=["sqlite", "postgres"])
def make_database(request: pytest.FixtureRequest, tmp_path: Path) -> DatabaseFactory:
    """A new connection each call to the same database: a SQLite file, or one PostgreSQL database."""
    if request.param == "sqlite":
        return lambda: SqliteDatabase(str(tmp_path / "apiary.db"))
    url = request.getfixturevalue("postgres_url")
    return lambda: PostgresDatabase(url)


@asynccontextmanager
async def tracker_client(make_database: DatabaseFactory, store: Path) -> AsyncIterator[TrackerClient]:
    """The tracker's API in this process, over a fresh connection to the database (as after a restart)."""
    db = make_database()
    await db.connect()
    try:
        async with in_process_client(Tracker(MemoryBus(), db, LocalStorage(store), Settings())) as client:
            yield client
    finally:
        await db.close()


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


async def test_two_uploads_at_once_get_different_ids_that_survive_a_restart(
        make_database: DatabaseFactory, tmp_path: Path) -> None:
    # Prepare
    records = [json.dumps({"text": "hello"}), json.dumps({"prompt": "a", "completion": "b"})]
    data = _jsonl(tmp_path / "chat.jsonl", records)
    store = tmp_path / "store"

    # Execute
    async with tracker_client(make_database, store) as api:
        first, second = await asyncio.gather(api.register("datasets", data, "one"),
                                             api.register("datasets", data, "two"))
    async with tracker_client(make_database, store) as api:
        listed = await api.registered("datasets")
        third = await api.register("datasets", data, "three")

    # Assert
    assert first["dataset_id"] != second["dataset_id"]
    assert {d["dataset_id"] for d in listed} == {first["dataset_id"], second["dataset_id"]}
    assert third["dataset_id"] > max(first["dataset_id"], second["dataset_id"])
    stored = await dataset_info(LocalStorage(store), third["dataset_id"])
    key = f"datasets/{third['dataset_id']}/three.jsonl"
    assert (stored["name"], stored["num_samples"], stored["key"]) == ("three", 2, key)


async def test_a_model_folder_is_registered_with_its_config(make_database: DatabaseFactory, tmp_path: Path) -> None:
    # Prepare
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("config.json", json.dumps({"model_type": "llama", "hidden_size": 32}))
    store = tmp_path / "store"

    # Execute
    async with tracker_client(make_database, store) as api:
        info = await api.register("models", archive, "tiny")
        again = await api.registered("models")

    # Assert
    stored = await model_info(LocalStorage(store), info["model_id"])
    assert stored["hf_config"] == {"model_type": "llama", "hidden_size": 32}
    assert (stored["format"], stored["key"]) == ("hf", f"models/{info['model_id']}/model.zip")
    assert again == [info]


async def test_a_bad_record_or_an_unknown_id_is_refused_naming_it(make_database: DatabaseFactory,
                                                                   tmp_path: Path) -> None:
    # Prepare
    bad = _jsonl(tmp_path / "bad.jsonl", [json.dumps({"text": "ok"}), json.dumps({"txt": "typo"})])
    request = {"name": "ft", "dataset_id": 41, "model_id": "7", "config": {"lora_r": 4}}

    # Execute
    async with tracker_client(make_database, tmp_path / "store") as api:
        with pytest.raises(TrackerError) as refused:
            await api.register("datasets", bad, "bad")
        with pytest.raises(TrackerError) as unknown:
            await api.submit_job(request)
        listed = await api.registered("datasets")

    # Assert
    assert refused.value.status_code == 422
    assert "bad.jsonl line 2: not a record of a known shape" in str(refused.value)
    assert unknown.value.status_code == 422
    assert "model_id: model 7 is unknown" in str(unknown.value)
    assert "dataset_id: dataset 41 is unknown" in str(unknown.value)
    assert listed == []


async def test_a_built_in_job_naming_its_model_by_path_is_refused_at_submission(make_database: DatabaseFactory,
                                                                                tmp_path: Path) -> None:
    # Prepare
    request = {"name": "ft", "dataset_id": 1, "model": "/models/tiny-llama", "config": {"lora_r": 4}}

    # Execute
    async with tracker_client(make_database, tmp_path / "store") as api:
        with pytest.raises(TrackerError) as by_path:
            await api.submit_job(request)

    # Assert
    assert by_path.value.status_code == 422
    assert "model: a built-in job fine-tunes a registered model: register '/models/tiny-llama'" in str(by_path.value)


async def test_a_large_upload_is_streamed_to_storage_never_held_whole(make_database: DatabaseFactory,
                                                                      tmp_path: Path) -> None:
    # Prepare: 48 MB of records, each line checked and counted on its way to storage
    line = json.dumps({"prompt": "q" * 400, "completion": "a" * 600})
    count = 48_000_000 // (len(line) + 1)
    data = _jsonl(tmp_path / "big.jsonl", [line] * count)

    # Execute
    async with tracker_client(make_database, tmp_path / "store") as api:
        tracemalloc.start()
        try:
            info = await api.register("datasets", data, "big")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()

    # Assert: the client sends it in chunks, the route writes them as they come, registration reads it by line;
    # what remains is a few of storage's 4 MiB hashing buffers, whatever the file's size
    assert info["num_samples"] == count and info["size"] == data.stat().st_size
    assert peak < data.stat().st_size / 2, f"peak {peak} bytes while registering {data.stat().st_size}"
