"""The protocol's values as bus messages (apiary.contracts) and back: keys, signatures, ciphertexts and shares
travel as hex; node ids are shard indexes + 1 in the protocol and shard indexes on the bus."""

from __future__ import annotations

from collections.abc import Sequence

from apiary.contracts import SecAggKeys, SecAggKeysOf, SecAggReveal, SecAggShare, SecAggShares, SecAggStage
from apiary.secagg.protocol import Advertisement, EncryptedShare, Reveal, SecAggError


def node(shard: int) -> int:
    """A shard's node id in the protocol (Shamir's x-coordinates start at 1)."""
    return shard + 1


def shard_of(node_id: int) -> int:
    """The shard of a node id."""
    return node_id - 1


def _bytes(text: str, what: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise SecAggError(f"{what} is not hex") from None


def advertisement(event: SecAggKeys | SecAggKeysOf) -> Advertisement:
    """A shard's advertised keys as the protocol takes them."""
    return Advertisement(node(event.shard), _bytes(event.c_public, "c_public"), _bytes(event.s_public, "s_public"),
                         _bytes(event.signature, "signature"))


def keys_of(ad: Advertisement) -> SecAggKeysOf:
    """An advertisement as the roster carries it."""
    return SecAggKeysOf(shard=shard_of(ad.node), c_public=ad.c_public.hex(), s_public=ad.s_public.hex(),
                        signature=ad.signature.hex())


def share(item: SecAggShare) -> EncryptedShare:
    """An encrypted share as the protocol takes it."""
    return EncryptedShare(node(item.source), node(item.destination), _bytes(item.ciphertext, "ciphertext"))


def shares_of(items: Sequence[EncryptedShare]) -> list[SecAggShare]:
    """Encrypted shares as messages carry them."""
    return [SecAggShare(source=shard_of(s.source), destination=shard_of(s.destination), ciphertext=s.ciphertext.hex())
            for s in items]


def reveal(event: SecAggReveal) -> Reveal:
    """A survivor's revealed shares as the protocol takes them."""
    return Reveal(node(event.shard), {node(k): _bytes(v, "share") for k, v in event.b_shares.items()},
                  {node(k): _bytes(v, "share") for k, v in event.s_shares.items()})


def revealed(r: Reveal) -> tuple[dict[int, str], dict[int, str]]:
    """A reveal's shares as SecAggReveal carries them (by shard)."""
    return ({shard_of(k): v.hex() for k, v in r.b_shares.items()},
            {shard_of(k): v.hex() for k, v in r.s_shares.items()})


def unmask_nodes(event: SecAggStage) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """An unmask stage's survivors and dropped shards as node ids."""
    return tuple(node(s) for s in event.survivors), tuple(node(s) for s in event.dropped)


__all__ = ["SecAggShares", "advertisement", "keys_of", "node", "reveal", "revealed", "shard_of", "share", "shares_of",
           "unmask_nodes"]
