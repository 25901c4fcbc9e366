"""docs/metrics.md names every instrument apiary.metrics makes: a new metric without its row fails here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from opentelemetry.metrics import NoOpMeter

from apiary.metrics import Instruments

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


class _Naming(NoOpMeter):
    """A no-op meter that remembers the name of every instrument made with it."""

    def __init__(self) -> None:
        super().__init__("naming")
        self.names: list[str] = []

    def __getattribute__(self, attr: str) -> Any:
        made = super().__getattribute__(attr)
        if attr.startswith("create_"):
            names = super().__getattribute__("names")

            def create(name: str, *args: Any, **kwargs: Any) -> Any:
                names.append(name)
                return made(name, *args, **kwargs)

            return create
        return made


def test_every_instrument_has_its_row_in_the_metrics_page() -> None:
    meter = _Naming()
    Instruments(meter)
    page = DOC.read_text()

    assert len(meter.names) >= 20
    assert [name for name in meter.names if f"`{name}`" not in page] == []
