"""Shamir's secret sharing of 32-byte secrets over the prime field GF(2**521 - 1): any `threshold` shares rebuild
the secret, fewer say nothing about it. Share x-coordinates are the holders' node ids (>= 1)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

PRIME = 2**521 - 1  # a Mersenne prime above every 32-byte secret
SECRET_BYTES = 32
SHARE_BYTES = 66  # a field element, big-endian


def split(secret: bytes, threshold: int, holders: Sequence[int]) -> dict[int, bytes]:
    """Shares of `secret` for each holder id (the polynomial of degree threshold-1 evaluated at the id)."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret is {SECRET_BYTES} bytes, got {len(secret)}")
    if not 1 <= threshold <= len(holders):
        raise ValueError(f"threshold {threshold} must be between 1 and the {len(holders)} holders")
    if len(set(holders)) != len(holders) or min(holders) < 1:
        raise ValueError("holder ids must be distinct and at least 1")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in holders:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares[x] = y.to_bytes(SHARE_BYTES, "big")
    return shares


def combine(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The secret from at least `threshold` shares (holder id -> share), by Lagrange interpolation at 0."""
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares cannot rebuild a secret that needs {threshold}")
    points = [(x, int.from_bytes(y, "big")) for x, y in sorted(shares.items())[:threshold]]
    secret = 0
    for i, (xi, yi) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (xj, _) in enumerate(points):
            if i != j:
                numerator = numerator * xj % PRIME
                denominator = denominator * (xj - xi) % PRIME
        secret = (secret + yi * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * SECRET_BYTES):
        raise ValueError("the shares do not rebuild a 32-byte secret (a corrupt or foreign share)")
    return secret.to_bytes(SECRET_BYTES, "big")
