"""The wheel (what the Docker images install) carries every package of the source tree."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _source_packages() -> set[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in config["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root).parts
            found.add(".".join((name, *relative)))
    return found


def test_every_source_package_is_in_the_wheel() -> None:
    # Prepare
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])

    # Execute
    present = _source_packages()

    # Assert
    assert present - listed == set(), "packages missing from pyproject.toml's [tool.setuptools] packages"
    assert listed - present == set(), "pyproject.toml lists packages that do not exist"
