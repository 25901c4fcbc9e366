"""Krum (`krum`): the contribution closest to its n - f - 2 nearest others (Blanchard et al., 2017), as
Flower 1.42's `aggregate_krum`; with `num_nodes_to_keep` > 0, the sample-weighted mean of that many
best-scored contributions (MultiKrum), as Flower's Krum does with `num_clients_to_keep`.

Squared distances between contributions are summed tensor by tensor and chunk by chunk (a pair's
squared distance is the sum over tensors), so the model is never held K times over; the chosen
contributions are then read back once more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from pydantic import BaseModel, Field

from apiary.strategies.base import StoredContributions, StrategyParams, register
from apiary.strategies.readback import ReadBack, column_blocks
from apiary.strategies.weighted_sum import WeightedSum


class KrumParams(StrategyParams):
    """Krum's parameters, with the names and defaults of Flower's Krum/MultiKrum."""

    num_malicious_nodes: int = Field(0, ge=0, description="f, the Byzantine contributions to tolerate")
    num_nodes_to_keep: int = Field(0, ge=0, description="MultiKrum: how many best contributions to average")


@register
class Krum(ReadBack):
    """Byzantine-robust selection: needs at least 2f + 3 contributions a round."""

    name = "krum"
    Params = KrumParams

    def __init__(self, params: BaseModel | None = None) -> None:
        super().__init__(params)
        settings = cast(KrumParams, self.params)
        self.malicious, self.keep = settings.num_malicious_nodes, settings.num_nodes_to_keep

    def check_job(self, num_shards: int, min_workers: int) -> None:
        """Refuse a job whose rounds may close with fewer than 2f + 3 contributions, or fewer than it keeps."""
        needed = max(2 * self.malicious + 3, self.keep)
        if min_workers < needed:
            raise ValueError(
                f"strategy {self.name!r} with num_malicious_nodes={self.malicious}, num_nodes_to_keep={self.keep} "
                f"needs at least {needed} contributions a round (2f + 3 and the kept ones), "
                f"but a round may close with min_workers={min_workers}"
            )

    def to_keep(self, count: int) -> int:
        """How many best contributions are averaged out of `count` (0: Krum's single choice)."""
        return min(self.keep, count)

    def _read_back(
        self, stored: StoredContributions, global_weights: Mapping[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        names = self.round_names(stored)
        chosen = select(distances(stored, names), self.malicious, self.to_keep(len(stored.samples)))
        if len(chosen) == 1:
            return {name: stored.tensor(name)[chosen[0]].clone() for name in names}
        samples = stored.samples
        out: dict[str, torch.Tensor] = {}
        for name in names:
            tensors, mean = stored.tensor(name), WeightedSum()
            for index in chosen:
                mean.fold({name: tensors[index]}, samples[index])
            out.update(mean.finish())
        return out


def distances(stored: StoredContributions, names: list[str]) -> torch.Tensor:
    """The K x K matrix of squared Euclidean distances between the contributions (float64)."""
    count = len(stored.samples)
    total = torch.zeros(count, count, dtype=torch.float64)
    for name in names:
        for _, block in column_blocks(stored.tensor(name)):
            # Differences, not |a|^2 + |b|^2 - 2ab: no cancellation between close contributions.
            norms = torch.cdist(block, block, compute_mode="donot_use_mm_for_euclid_dist")
            total += norms.double().square_()
    return total


def select(squared: torch.Tensor, malicious: int, keep: int) -> list[int]:
    """Flower's choice: score each contribution by its n - f - 2 smallest distances to others (its own,
    zero, sorts first and is skipped); the lowest score, or the `keep` lowest (worst of them first)."""
    count = squared.shape[0]
    closest = max(1, count - malicious - 2)
    scores = squared.sort(dim=1).values[:, 1:closest + 1].sum(dim=1)
    if keep <= 0:
        return [int(scores.argmin())]
    return [int(i) for i in scores.argsort(stable=True)[:keep].flip(0)]
