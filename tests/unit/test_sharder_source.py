"""Where a job's dataset is, from its reference alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from apiary.dataset import DatasetError
from services.sharder.source import DatasetLocation, locate

OWN = "s3://bucket/prefix/"


def test_a_file_uri_is_a_local_path_used_as_given() -> None:
    assert locate("file:///data/my%20set", OWN) == DatasetLocation(path=Path("/data/my set"))


def test_a_plain_path_is_local_and_checked() -> None:
    assert locate("data/set.zip", OWN) == DatasetLocation(path=Path("data/set.zip"), plain=True)


def test_a_uri_in_this_storage_is_a_key() -> None:
    assert locate("s3://bucket/prefix/datasets/7/set.zip", OWN) == DatasetLocation(key="datasets/7/set.zip")


def test_a_uri_outside_this_storage_is_refused() -> None:
    with pytest.raises(DatasetError, match="outside this deployment's storage"):
        locate("s3://other/set.zip", OWN)
