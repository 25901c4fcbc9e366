"""MultiKrum (`multikrum`): the sample-weighted mean of the `num_nodes_to_keep` contributions Krum
scores best (El Mhamdi et al., 2018), as Flower 1.42's `aggregate_krum` with `to_keep`."""

from __future__ import annotations

from apiary.strategies.base import register
from apiary.strategies.krum import Krum


@register
class MultiKrum(Krum):
    """Krum's scores, several contributions kept; `num_nodes_to_keep=0` keeps n - f (the paper's m)."""

    name = "multikrum"

    def to_keep(self, count: int) -> int:
        """How many best contributions are averaged out of `count`."""
        return min(self.keep or count - self.malicious, count)
