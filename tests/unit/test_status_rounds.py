"""`apiary status` and `apiary run`'s live view: each round's training and validation loss side by side."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from services.app.render import render_job


def _printed(view: dict[str, Any]) -> list[str]:
    console = Console(width=160, record=True, color_system=None)
    console.print(render_job(view))
    return console.export_text().splitlines()


def _view(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {"job_id": "j1", "name": "llm", "status": "running", "round": len(rounds), "num_rounds": 3,
            "attempt": 1, "shards": [], "rounds": rounds}


def test_each_round_prints_its_loss_and_val_loss_in_their_own_columns() -> None:
    # Prepare
    view = _view([
        {"round": 1, "attempt": 1, "status": "aggregated", "metrics": {"loss": 2.5, "val_loss": 2.75, "acc": 0.5}},
        {"round": 2, "attempt": 1, "status": "aggregated", "metrics": {"loss": 1.25, "val_loss": 1.5}},
    ])

    # Execute
    lines = _printed(view)

    # Assert
    header = next(line for line in lines if "val_loss" in line and "round" in line)
    assert header.split()[:4] == ["round", "status", "loss", "val_loss"]
    assert ["1", "aggregated", "2.5000", "2.7500", "acc=0.5"] in [line.split() for line in lines]
    assert ["2", "aggregated", "1.2500", "1.5000"] in [line.split() for line in lines]


def test_a_round_without_val_loss_shows_a_dash_and_a_failed_round_its_reason() -> None:
    # Prepare
    view = _view([
        {"round": 1, "attempt": 1, "status": "aggregated", "metrics": {"loss": 0.5}},
        {"round": 2, "attempt": 1, "status": "failed", "metrics": {}, "reason": "too few workers"},
    ])

    # Execute
    rows = [line.split() for line in _printed(view)]

    # Assert
    assert ["1", "aggregated", "0.5000", "-"] in rows
    assert ["2", "failed", "-", "-", "too", "few", "workers"] in rows


def test_each_round_prints_its_evaluation_or_why_it_failed() -> None:
    # Prepare: round 1 evaluated on a worker, round 2's evaluation failed, round 3 not evaluated (yet)
    view = _view([
        {"round": 1, "attempt": 1, "status": "aggregated", "metrics": {"loss": 0.5},
         "evaluation": {"accuracy": 0.9125, "loss": 0.25}},
        {"round": 2, "attempt": 1, "status": "aggregated", "metrics": {"loss": 0.4},
         "evaluation_error": "RuntimeError: no held-out data (train.py:9 in fl_evaluate_model)"},
        {"round": 3, "attempt": 1, "status": "aggregated", "metrics": {"loss": 0.3}, "evaluation": None},
    ])

    # Execute
    lines = _printed(view)
    rows = [line.split() for line in lines]

    # Assert
    assert "evaluation" in next(line for line in lines if "val_loss" in line and "round" in line)
    assert ["1", "aggregated", "0.5000", "-", "accuracy=0.9125,", "loss=0.25"] in rows
    assert ["2", "aggregated", "0.4000", "-", "failed:", "RuntimeError:", "no", "held-out", "data",
            "(train.py:9", "in", "fl_evaluate_model)"] in rows
    assert ["3", "aggregated", "0.3000", "-"] in rows


def test_a_secure_round_prints_what_secure_aggregation_did() -> None:
    # Prepare: round 1 unmasked with shard 2 dropped after sharing keys; round 2 failed at the consistency check
    unmasked = {"stage": "unmasked", "threshold": 2, "num_shares": 3, "participants": [0, 1, 2],
                "shared": [0, 1, 2], "survivors": [0, 1], "signers": [0, 1], "revealed": [0, 1], "dropped": [2]}
    stopped = {"stage": "check", "threshold": 2, "num_shares": 3, "participants": [0, 1, 2], "shared": [0, 1, 2],
               "survivors": [0, 1, 2], "signers": [0], "revealed": [], "dropped": []}
    view = _view([
        {"round": 1, "attempt": 1, "status": "aggregated", "metrics": {"loss": 0.5}, "secure_aggregation": unmasked},
        {"round": 2, "attempt": 1, "status": "failed", "metrics": {}, "reason": "too few signed",
         "secure_aggregation": stopped},
    ])

    # Execute
    text = " ".join(" ".join(line.split()) for line in _printed(view))

    # Assert
    assert "secure aggregation" in text
    assert ("unmasked; threshold 2 of 3; participants 0,1,2; masked 0,1; dropped 2 (recovered from shares); "
            "signed 0,1; shares from 0,1") in text
    assert "check; threshold 2 of 3; participants 0,1,2; masked 0,1,2; signed 0" in text


def test_a_round_in_the_clear_has_no_secure_aggregation_column() -> None:
    view = _view([{"round": 1, "attempt": 1, "status": "aggregated", "metrics": {"loss": 0.5}}])

    assert not any("secure aggregation" in line for line in _printed(view))
