"""Secure aggregation (SecAgg+, Bell et al. 2020, as Flower 1.42 names and configures it): the aggregator learns
the weighted sum of the round's updates and nothing about any one of them.

Pure protocol pieces, no I/O: `settings` (the job's `distributed.secure_aggregation`), `quantize` (fixed point
with stochastic rounding, and the error bound), `shamir` (secret sharing over a prime field), `crypto` (X25519
key agreement, HKDF, AES-GCM, Ed25519 signatures: all from the `cryptography` package), `masks` (mask vectors
from seeds by a ChaCha20 keystream) and `protocol` (the participant's and the collector's state machines,
stage by stage). docs/security.md states what it protects against.
"""
