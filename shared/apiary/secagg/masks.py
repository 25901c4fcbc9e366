"""Mask vectors from 32-byte seeds: a ChaCha20 keystream (the `cryptography` package's) read as little-endian
uint32 words, reduced to the ring [0, modulus). A power-of-2 modulus up to 2**32 keeps the words uniform."""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

NONCE = bytes(16)  # each seed masks one vector of one round: a fixed nonce never repeats a (key, nonce) pair


def mask(seed: bytes, length: int, modulus: int) -> np.ndarray:
    """`length` uniform values in [0, modulus) as uint64, determined by `seed`."""
    stream = Cipher(algorithms.ChaCha20(seed, NONCE), mode=None).encryptor().update(bytes(4 * length))
    return np.frombuffer(stream, dtype="<u4").astype(np.uint64) & np.uint64(modulus - 1)


def ring(values: np.ndarray, modulus: int) -> np.ndarray:
    """`values` (uint64, wrapped) reduced to [0, modulus)."""
    return values & np.uint64(modulus - 1)
