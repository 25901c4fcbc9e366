"""Deterministic toy entrypoints for tests: exact arithmetic, tiny tensors, chosen failures."""
