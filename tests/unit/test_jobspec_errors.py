"""A rejected request names every problem at once: unknown fields (with the nearest known name) and the
rules across fields that a bad field kept pydantic from reaching."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from apiary.jobspec import JobSpec, cross_field_errors, field_errors

GOOD: dict[str, Any] = {"name": "x", "entrypoint": "pkg.mod:fn", "dataset": "d",
                        "distributed": {"num_rounds": 2, "min_workers": 1, "max_workers": 2}}


def _lines(request: dict[str, Any]) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(request)
    return [f"{e.field}: {e.message}" for e in field_errors(caught.value, request)]


def test_a_misspelt_field_and_min_above_max_are_both_reported() -> None:
    request = {**GOOD, "distributed": {"num_round": 5, "min_workers": 4, "max_workers": 2}}

    lines = _lines(request)

    assert lines == ["distributed.num_round: unknown field (did you mean num_rounds?)",
                     "distributed: min_workers (4) must not exceed max_workers (2)"]


def test_a_rule_pydantic_reached_is_reported_once() -> None:
    lines = _lines({**GOOD, "distributed": {"min_workers": 4, "max_workers": 2}})

    assert lines == ["distributed: min_workers (4) must not exceed max_workers (2)"]


@pytest.mark.parametrize(("loc", "hint"), [
    (("entrypiont",), " (did you mean entrypoint?)"),
    (("worker_selection", "mdoe"), " (did you mean mode?)"),
    (("surprise",), ""),
])
def test_an_unknown_field_names_the_nearest_known_one_of_its_block(loc: tuple[str, ...], hint: str) -> None:
    request: dict[str, Any] = {**GOOD, loc[0]: 1} if len(loc) == 1 else {**GOOD, loc[0]: {loc[1]: 1}}

    lines = _lines(request)

    assert f"{'.'.join(loc)}: unknown field{hint}" in lines


@pytest.mark.parametrize("distributed", [{"enabled": False, "min_workers": 4, "max_workers": 2},
                                         {"min_workers": "4", "max_workers": 2}, "not a block"])
def test_no_rule_across_fields_is_guessed_from_values_it_does_not_apply_to(distributed: Any) -> None:
    assert cross_field_errors({**GOOD, "distributed": distributed}) == []
