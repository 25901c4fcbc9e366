"""The docs cannot show an example that fails: every code block marked `<!-- runnable -->` in README.md and
docs/ runs here (shell in a subprocess from the repository root, Python in-process, JSON and YAML validated as a job
request, within a minimal one where it is a fragment). `<!-- runnable slow -->` blocks run in the slow
lane."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from apiary.contracts import JobRequested

ROOT = Path(__file__).resolve().parents[2]
# What a YAML fragment (a `distributed:` section, say) is validated within.
FRAGMENT_OF = {"name": "example", "entrypoint": "examples.digits.train:fl_train_model", "dataset": "data"}
BLOCK = re.compile(r"^<!-- runnable( slow)? -->\n```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    where: str
    language: str
    code: str
    slow: bool


def examples() -> list[Example]:
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        for match in BLOCK.finditer(text):
            line = text[: match.start()].count("\n") + 2
            found.append(Example(f"{page.relative_to(ROOT)}:{line}", match[2], match[3], bool(match[1])))
    return found


def _params(slow: bool) -> list[object]:
    chosen = [e for e in examples() if e.slow == slow]
    return [pytest.param(e, id=e.where, marks=[pytest.mark.slow] if slow else []) for e in chosen]


def _run(example: Example) -> None:
    if example.language in ("bash", "sh"):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "shared"), str(ROOT),
                                                            os.environ.get("PYTHONPATH", "")]),
               "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", example.code], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{example.where} failed:\n{done.stdout}\n{done.stderr}"
    elif example.language == "python":
        exec(compile(example.code, example.where, "exec"), {"__name__": "docs_example"})
    elif example.language == "json":
        JobRequested.model_validate_json(example.code)
    elif example.language == "yaml":
        block = yaml.safe_load(example.code)
        JobRequested.model_validate(block if "name" in block else {**FRAGMENT_OF, **block})
    else:
        raise AssertionError(f"{example.where}: no way to run a {example.language} block")


def test_the_docs_have_runnable_examples_of_each_kind() -> None:
    assert {e.language for e in examples()} >= {"bash", "python", "yaml", "json"}


def test_the_readme_is_short_and_its_links_lead_somewhere() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)]+)\)", readme) if "://" not in t]

    assert len(readme.splitlines()) <= 150
    assert [t for t in targets if not (ROOT / t).exists()] == []


@pytest.mark.parametrize("example", _params(slow=False))
def test_a_runnable_example_runs(example: Example) -> None:
    _run(example)


@pytest.mark.parametrize("example", _params(slow=True))
def test_a_slow_runnable_example_runs(example: Example) -> None:
    _run(example)
