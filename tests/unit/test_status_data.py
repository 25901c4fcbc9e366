"""`apiary status` shows what each worker receives: the split and each shard's samples per label."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from services.app.render import label_text, render_job


def _printed(view: dict[str, Any]) -> list[str]:
    console = Console(width=160, record=True, color_system=None)
    console.print(render_job(view))
    return console.export_text().splitlines()


def _view(**extra: Any) -> dict[str, Any]:
    return {"job_id": "j1", "name": "digits", "status": "running", "round": 1, "num_rounds": 3, "attempt": 1,
            "shards": [], "rounds": [], **extra}


def test_each_shard_prints_its_sample_count_and_labels_under_the_split() -> None:
    # Prepare
    view = _view(split={"strategy": "label_skew", "alpha": 0.1, "seed": 3, "key": "group"},
                 data_shards=[{"shard": 0, "num_samples": 7, "labels": {"10": 2, "2": 5}},
                              {"shard": 1, "num_samples": 4, "labels": {"0": 4}}])

    # Execute
    lines = _printed(view)

    # Assert
    assert "data: label_skew alpha=0.1 seed=3" in [line.strip() for line in lines]
    assert ["0", "7", "2:5", "10:2"] in [line.split() for line in lines]
    assert ["1", "4", "0:4"] in [line.split() for line in lines]


def test_an_unlabelled_dataset_shows_counts_and_a_dash_and_no_data_means_no_table() -> None:
    lines = _printed(_view(split={"strategy": "random", "alpha": 0.5, "seed": 0},
                           data_shards=[{"shard": 0, "num_samples": 9, "labels": None}]))

    assert "data: random seed=0" in [line.strip() for line in lines]
    assert ["0", "9", "-"] in [line.split() for line in lines]
    assert not any(line.strip().startswith("data:") for line in _printed(_view()))


def test_a_long_histogram_is_cut_with_a_count_of_the_rest() -> None:
    text = label_text({str(i): 1 for i in range(15)})

    assert text.startswith("0:1 1:1 2:1")
    assert text.endswith("11:1 +3 more")
