"""How hard the fuzz tests push: `FUZZ`, a hypothesis settings decorator. The normal test run takes a few dozen
examples per decoder, seeded (the same inputs every run); scripts/fuzz.py sets APIARY_FUZZ_EXAMPLES to run
thousands, fresh each time."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_EXAMPLES = os.environ.get("APIARY_FUZZ_EXAMPLES")

# A decoder that takes longer than `deadline` on one small input counts as hanging.
FUZZ = settings(max_examples=int(_EXAMPLES or 40), deadline=5000 if _EXAMPLES else 2000,
                derandomize=_EXAMPLES is None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
