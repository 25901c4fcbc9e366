"""The benchmark pages: each has its JSON results beside it, linked from the page, written by its script."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "docs" / "benchmarks"
# Pages whose figures come from scripts with a format of their own (per setting, per K and replica count, per run).
OWN_FORMAT = {"accuracy", "accuracy-shard-state", "async", "scale"}
METADATA = {"benchmark", "command", "measured_at", "commit", "machine", "reference", "figures"}


def benchmark_pages() -> list[Path]:
    return sorted(p for p in PAGES.glob("*.md") if p.name != "index.md")


@pytest.mark.parametrize("page", benchmark_pages(), ids=lambda p: p.stem)
def test_every_benchmark_page_has_its_results_beside_it_and_links_them(page: Path) -> None:
    results = page.with_suffix(".json")
    assert results.is_file(), f"{page.name} has no {results.name} beside it: run its script (see the page)"
    document = json.loads(results.read_text())
    assert f"]({results.name})" in page.read_text(), f"{page.name} does not link {results.name}"
    if page.stem not in OWN_FORMAT:
        assert METADATA <= document.keys(), f"{results.name} lacks {sorted(METADATA - document.keys())}"
        assert document["benchmark"] == page.stem
        assert document["command"].startswith("python scripts/bench_")
        assert document["figures"], f"{results.name} holds no figures"


@pytest.mark.parametrize("page", benchmark_pages(), ids=lambda p: p.stem)
def test_no_benchmark_page_speaks_of_figures_it_does_not_have(page: Path) -> None:
    text = page.read_text()
    assert not re.search(r"not recorded|does not write a JSON|writes a JSON file yet", text, re.IGNORECASE), page.name


@pytest.mark.parametrize("page", [p for p in benchmark_pages() if p.stem not in OWN_FORMAT], ids=lambda p: p.stem)
def test_each_page_s_script_records_its_figures_beside_it(page: Path) -> None:
    script = ROOT / "scripts" / f"bench_{page.stem}.py"
    assert script.is_file(), f"{page.name} has no scripts/{script.name}"
    text = script.read_text()
    assert f'add_json_argument(parser, "{page.stem}")' in text and f'record("{page.stem}"' in text, script.name
