"""Secure aggregation (SecAgg+, Bell et al. 2020, as Flower 1.42 names and configures it): the aggregator learns
the weighted sum of the round's updates and nothing about any one of them.

Pure protocol pieces, no I/O: `settings` (the job's `distributed.secure_aggregation`), `quantize` (fixed point
with stochastic rounding, and the error bound), `shamir` (secret sharing over a prime field), `crypto` (X25519
key agreement, HKDF, AES-GCM, Ed25519 signatures: all from the `cryptography` package), `masks` (mask vectors
from seeds by a ChaCha20 keystream), `protocol` (the participant's and the collector's state machines, stage by
stage), `updates` (a worker's update as the protocol's vector, numpy only), `aggregate` and `strategy` (the
unmasked mean as the round's one contribution to a weighted-sum strategy) and `messages` (the bus's form of the
protocol's values). The services carry the stages: services/worker/secure_rounds.py and
services/aggregator/secure_rounds.py. docs/security.md states what it protects against.
"""
