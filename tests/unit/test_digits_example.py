"""The digits example's job files and its FedProx term, on a few real images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from apiary.jobspec import JobSpec
from examples.digits import prepare, train
from services.app.jobfile import load_job_file

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits"


@pytest.mark.parametrize(("name", "shards"), [("job.yaml", 3), ("job-8workers.yaml", 8)])
def test_the_shipped_job_files_are_valid_jobs_of_their_size(name: str, shards: int) -> None:
    spec = JobSpec.model_validate(load_job_file(DIGITS / name))

    assert spec.num_shards == shards
    assert spec.entrypoint == "examples.digits.train:fl_train_model"


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a) ** 0.5


def test_proximal_mu_keeps_a_round_near_the_global_weights(tmp_path: Path) -> None:
    # Prepare: 40 random 8x8 images as a dataset folder (as prepare.py writes one), the round's global weights.
    images = torch.randint(0, 17, (40, 8, 8), dtype=torch.uint8).numpy()
    prepare.write_dataset(tmp_path / "shard", "digits-test", images, torch.arange(40).remainder(10).numpy())
    env = {"EPOCHS": 3, "BATCH_SIZE": 8, "LEARNING_RATE": 0.01, "SEED": 0}
    start = train.fl_init_weights(env)

    def trained(mu: float) -> dict[str, torch.Tensor]:
        payload = {"env": {**env, "PROXIMAL_MU": mu}, "initial_weights": start,
                   "dataset": {"data_root": str(tmp_path / "shard"), "shard_index": 0}, "round": {"index": 1}}
        return train.fl_train_model(payload, str(tmp_path / "out"))["weights"]

    # Execute
    free, held = _distance(trained(0.0), start), _distance(trained(100.0), start)

    # Assert
    assert free > 0
    assert held < free / 2
