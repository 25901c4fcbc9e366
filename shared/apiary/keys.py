"""Where a job's objects live in storage: everything under `jobs/<job_id>/`."""

from __future__ import annotations


def job_prefix(job_id: str) -> str:
    """Every object of a job starts with this."""
    return f"jobs/{job_id}/"


def shard(job_id: str, index: int) -> str:
    """One shard zip."""
    return f"jobs/{job_id}/shards/shard-{index:04d}.zip"


def global_weights(job_id: str, round_index: int) -> str:
    """The global weights after `round_index` (0: the initial weights)."""
    return f"jobs/{job_id}/rounds/{round_index:04d}/global.safetensors"


def strategy_state(job_id: str, round_index: int) -> str:
    """The strategy's server state (momentum, moments, ...) after `round_index`, beside its global weights."""
    return f"jobs/{job_id}/rounds/{round_index:04d}/strategy-state.safetensors"


def contribution(job_id: str, round_index: int, attempt: int, shard_index: int) -> str:
    """One worker's returned weights for one shard."""
    return f"jobs/{job_id}/rounds/{round_index:04d}/attempt-{attempt}/shard-{shard_index:04d}.safetensors"


def shard_state(job_id: str, shard_index: int, round_index: int, attempt: int) -> str:
    """A shard's state as its training in `round_index` (attempt) left it: kept with the shard, not the worker."""
    return f"jobs/{job_id}/shard-state/shard-{shard_index:04d}/round-{round_index:04d}-attempt-{attempt}.safetensors"


def kept_shard_state(job_id: str, shard_index: int, sha256: str) -> str:
    """A shard's accepted state, copied by the aggregator under its sha256: a second upload to the assignment's key
    (its assignment trained twice) cannot change the state the next round is handed."""
    return f"jobs/{job_id}/shard-state/shard-{shard_index:04d}/kept-{sha256}.safetensors"


def final_shard_state(job_id: str, shard_index: int) -> str:
    """A shard's last state beside the job's final model (its personal layers as `personal.<name>`)."""
    return f"jobs/{job_id}/final/shards/shard-{shard_index:04d}.safetensors"


def run_files(job_id: str, round_index: int, attempt: int, shard_index: int) -> str:
    """The files a training function wrote to its out_dir, zipped."""
    return f"jobs/{job_id}/rounds/{round_index:04d}/attempt-{attempt}/files-shard-{shard_index:04d}.zip"


def job_ended(job_id: str) -> str:
    """Written once a job is cancelled or fails: a worker that started listening later reads it
    before training one of the job's assignments still queued."""
    return f"jobs/{job_id}/ended.json"


def final_model(job_id: str) -> str:
    """The job's final model."""
    return f"jobs/{job_id}/final/model.safetensors"


def final_metrics(job_id: str) -> str:
    """The job's metrics, per round and final."""
    return f"jobs/{job_id}/final/metrics.json"


def dataset(dataset_id: str, name: str) -> str:
    """An uploaded dataset."""
    return f"datasets/{dataset_id}/{name}"


def code_bundle(sha256: str) -> str:
    """A code bundle, content-addressed: the same code is stored once, whoever ships it."""
    return f"code/{sha256}.zip"


def halved_weights(job_id: str, sha256: str, precision: str) -> str:
    """Global weights (by their sha256) halved to `precision` for download (distributed.transfer.download)."""
    return f"jobs/{job_id}/wire/global-{sha256[:32]}-{precision}.safetensors"
