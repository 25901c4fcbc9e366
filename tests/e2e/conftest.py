"""The embedded stack's fixtures live in tests/fixtures/embedded.py (a plugin for every test folder)."""

from tests.fixtures.embedded import REPO, StackFactory, toy_request

__all__ = ["REPO", "StackFactory", "toy_request"]
