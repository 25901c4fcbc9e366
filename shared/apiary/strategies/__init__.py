"""Aggregation strategies: one pure class per strategy behind `base.Strategy`, found by name.

Nothing is imported here, so `apiary.strategies.format` stays free of torch (the bus contracts use
it); `base.create(name, params)` finds every strategy module of this package on first use.
"""

DEFAULT_STRATEGY = "federated_averaging"  # what a round uses when its job names none
