"""SecAgg+ stage by stage, as two pure state machines: a round's `Participant` (one per worker and shard; node id
= shard index + 1) and the aggregator's `Collector`. The services carry their messages over the bus; nothing here
does I/O.

1. advertise: each participant draws two X25519 key pairs (c: to encrypt shares, s: to agree masks) and signs
   both public keys, with the round's context, by its shard's Ed25519 key (derived from its assignment's one-time
   secret, crypto.signing_key_from_secret; every shard's verify key comes from the scheduler): the aggregator,
   which relays them, cannot substitute its own. The collector's roster is the participants that advertised (U1).
2. share keys: each participant verifies the roster, takes its neighbours (a ring over the node ids, num_shares
   wide, itself included), draws a self-mask seed b, Shamir-splits b and its s private key among them
   (threshold t) and sends each neighbour its two shares encrypted under AES-GCM with a key agreed from the c
   keys. The collector forwards them; the senders are U2.
3. masked input: each participant decrypts its shares, quantises `(n / max_weight) * update` (stochastic
   rounding), appends its sample count n (exact, in the ring), adds PRG(b) and, for each neighbour v in U2,
   +PRG(s_uv) if u > v else -PRG(s_uv) (mod M). The collector sums the masked vectors in the ring (U3).
4. consistency check (Bonawitz et al. 2017): the collector fixes the survivors U3 (whose masked vectors it
   holds) and tells each of them; each signs U3 with its shard's Ed25519 key. The signers are U4.
5. unmask: the collector asks each signer for its shares of b for U3 and of s for U2 \\ U3, with every
   signature it has over U3. A participant reveals only if at least t of them are valid signatures, by nodes of
   U3, over the very set it signed, and the request names no node of U3 as dropped and none outside it as a
   survivor (nor one node both ways). With t shares each the collector removes every self mask and the
   pairwise masks of dropped participants; the pairs among U3 cancel. Left: the sum of quantised weighted
   updates and the sum of sample counts; dequantised and divided, the weighted mean update.

What it protects: the aggregator (and storage) hold masked vectors only; fewer than t colluding neighbours of a
worker learn nothing of its masks. Against an aggregator that lies about who dropped (telling some workers a
node survived, to get shares of its self mask, and others that it dropped, to get shares of its mask key): an
honest participant signs one survivor set and reveals one of a node's two secrets, so the lie needs 2t of the
node's neighbours (t > num_shares / 2 rules it out), and every revealer acted on a set t participants signed
(t > half the participants: one set a round). docs/security.md says more.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from apiary.secagg import crypto, shamir
from apiary.secagg.masks import mask, ring
from apiary.secagg.quantize import dequantize_sum, quantize
from apiary.secagg.settings import Resolved

SHARE_PURPOSE, MASK_PURPOSE = b"apiary secagg share", b"apiary secagg mask"


class SecAggError(ValueError):
    """A stage cannot go on: a forged or missing key, too few participants left, a malformed message."""


@dataclass(frozen=True)
class Advertisement:
    """Stage 1: a participant's two public keys, signed with its assignment's key."""

    node: int
    c_public: bytes
    s_public: bytes
    signature: bytes


@dataclass(frozen=True)
class EncryptedShare:
    """Stage 2: one participant's shares of b and of its s key for one neighbour, encrypted for it."""

    source: int
    destination: int
    ciphertext: bytes


@dataclass(frozen=True)
class UnmaskRequest:
    """Stage 5: whose b shares (survivors) and whose s-key shares (dropped) the collector asks a signer for, with
    the signatures over U3 it holds."""

    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    signatures: Mapping[int, bytes] = field(default_factory=dict)  # node -> its signature over U3


@dataclass(frozen=True)
class Reveal:
    """Stage 5: a survivor's shares, per owner node."""

    node: int
    b_shares: Mapping[int, bytes]
    s_shares: Mapping[int, bytes]


def signed_bytes(context: bytes, node: int, c_public: bytes, s_public: bytes) -> bytes:
    """What a participant signs: the round, its node id and its two public keys."""
    return b"apiary secagg keys|" + context + b"|" + struct.pack(">Q", node) + c_public + s_public


def survivors_bytes(context: bytes, survivors: Iterable[int]) -> bytes:
    """What a participant signs in the consistency check: the round and the survivor set U3, in order."""
    return b"apiary secagg survivors|" + context + b"|" + b"".join(struct.pack(">Q", n) for n in sorted(set(survivors)))


def neighbours(node: int, nodes: Sequence[int], num_shares: int) -> frozenset[int]:
    """`node`'s neighbours among `nodes` (itself included): num_shares // 2 either side on the ring of sorted
    ids, or all where the ring is narrower than num_shares. Every party computes it alike from the roster."""
    ring_ids = sorted(nodes)
    if num_shares >= len(ring_ids):
        return frozenset(ring_ids)
    half, at = num_shares // 2, ring_ids.index(node)
    return frozenset(ring_ids[(at + offset) % len(ring_ids)] for offset in range(-half, half + 1))


def _share_associated(context: bytes, source: int, destination: int) -> bytes:
    return context + struct.pack(">QQ", source, destination)


def pairwise_mask(s_private: bytes, peer_s_public: bytes, context: bytes, length: int, modulus: int) -> np.ndarray:
    """The mask two participants agree on for the round."""
    return mask(crypto.agree(s_private, peer_s_public, MASK_PURPOSE, context), length, modulus)


@dataclass
class Participant:
    """One worker's side of one round (node id = shard index + 1)."""

    node: int
    context: bytes
    params: Resolved
    signing_key: bytes
    verify_keys: Mapping[int, bytes]
    c_private: bytes = field(default_factory=crypto.new_private_key)
    s_private: bytes = field(default_factory=crypto.new_private_key)
    b_seed: bytes = field(default_factory=lambda: os.urandom(shamir.SECRET_BYTES))
    roster: dict[int, Advertisement] = field(default_factory=dict)
    held: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # owner -> (b share, s share) held here
    mine: frozenset[int] = frozenset()  # this node's neighbours in the roster
    masked_with: frozenset[int] = frozenset()  # U2 within the neighbours
    survivors: frozenset[int] = frozenset()  # U3 as this node signed it (the consistency check)

    def advertise(self) -> Advertisement:
        """Stage 1: the signed public keys."""
        c_public, s_public = crypto.public_key(self.c_private), crypto.public_key(self.s_private)
        signature = crypto.sign(self.signing_key, signed_bytes(self.context, self.node, c_public, s_public))
        return Advertisement(self.node, c_public, s_public, signature)

    def share_keys(self, roster: Sequence[Advertisement]) -> list[EncryptedShare]:
        """Stage 2: verify every advertisement, split b and the s key among the neighbours, encrypt theirs."""
        for ad in roster:
            expected = self.verify_keys.get(ad.node)
            if expected is None:
                raise SecAggError(f"node {ad.node} is not a shard of this round")
            try:
                crypto.verify(expected, ad.signature, signed_bytes(self.context, ad.node, ad.c_public, ad.s_public))
            except crypto.CryptoError:
                raise SecAggError(f"node {ad.node}'s keys are not signed by its assignment key: refusing the "
                                  "round (a substituted key)") from None
        self.roster = {ad.node: ad for ad in roster}
        if self.node not in self.roster or self.roster[self.node].s_public != crypto.public_key(self.s_private):
            raise SecAggError(f"the roster lacks node {self.node}'s own keys")
        self.mine = neighbours(self.node, list(self.roster), self.params.num_shares)
        if len(self.mine) < self.params.threshold:
            raise SecAggError(f"{len(self.mine)} neighbours advertised, the threshold is {self.params.threshold}")
        holders = sorted(self.mine)
        b_shares = shamir.split(self.b_seed, self.params.threshold, holders)
        s_shares = shamir.split(self.s_private, self.params.threshold, holders)
        self.held = {self.node: (b_shares[self.node], s_shares[self.node])}
        out = []
        for v in holders:
            if v == self.node:
                continue
            key = crypto.agree(self.c_private, self.roster[v].c_public, SHARE_PURPOSE, self.context)
            out.append(EncryptedShare(self.node, v, crypto.encrypt(key, b_shares[v] + s_shares[v],
                                                                   _share_associated(self.context, self.node, v))))
        return out

    def masked_input(self, forwarded: Sequence[EncryptedShare], update: np.ndarray, samples: int,
                     rng: np.random.Generator | None = None) -> tuple[np.ndarray, int]:
        """Stage 3: keep the shares sent here, then the masked vector of `update` weighted by `samples` (its
        sample count appended), and how many weighted values were clipped to clipping_range."""
        p = self.params
        if not 0 < samples <= p.max_weight:
            raise SecAggError(f"a contribution of {samples} samples is outside (0, max_weight {p.max_weight:g}]: "
                              "raise secure_aggregation.max_weight")
        for share in forwarded:
            if share.destination != self.node or share.source not in self.mine:
                raise SecAggError(f"a share from node {share.source} to node {share.destination} is not for this "
                                  "node's neighbourhood")
            key = crypto.agree(self.c_private, self.roster[share.source].c_public, SHARE_PURPOSE, self.context)
            plain = crypto.decrypt(key, share.ciphertext, _share_associated(self.context, share.source, self.node))
            if len(plain) != 2 * shamir.SHARE_BYTES:
                raise SecAggError(f"node {share.source}'s shares are malformed")
            self.held[share.source] = (plain[:shamir.SHARE_BYTES], plain[shamir.SHARE_BYTES:])
        self.masked_with = frozenset({self.node, *(s.source for s in forwarded)})
        if len(self.masked_with) < p.threshold:
            raise SecAggError(f"{len(self.masked_with)} neighbours shared keys, the threshold is {p.threshold}")
        weighted = np.asarray(update, dtype=np.float64) * (samples / p.max_weight)
        q, clipped = quantize(weighted, p.clipping_range, p.quantization_range, rng or np.random.default_rng())
        vector = np.append(q, np.uint64(samples))
        length, modulus = vector.size, p.modulus_range
        vector += mask(self.b_seed, length, modulus)
        for v in sorted(self.masked_with - {self.node}):
            pair = pairwise_mask(self.s_private, self.roster[v].s_public, self.context, length, modulus)
            if self.node > v:
                vector += pair
            else:
                vector -= pair
        return ring(vector, modulus), clipped

    def check(self, survivors: Iterable[int]) -> bytes:
        """Stage 4: this node's signature over the survivor set U3 it is told of; SecAggError if the set leaves
        it out, names nodes outside the roster, is below the threshold, or differs from one it signed before."""
        told = frozenset(survivors)
        if not self.masked_with:
            raise SecAggError("asked to sign a survivor set before masking its input")
        if self.node not in told:
            raise SecAggError(f"node {self.node} is told it did not survive, after it sent its masked input")
        if told - set(self.roster):
            raise SecAggError(f"the survivor set names node(s) {sorted(told - set(self.roster))} outside the roster")
        if len(told) < self.params.threshold:
            raise SecAggError(f"{len(told)} survivors are fewer than the threshold {self.params.threshold}")
        if self.survivors and told != self.survivors:
            raise SecAggError("told two different survivor sets: refusing")
        self.survivors = told
        return crypto.sign(self.signing_key, survivors_bytes(self.context, told))

    def unmask(self, request: UnmaskRequest) -> Reveal:
        """Stage 5: this node's shares of the survivors' b and the dropped nodes' s keys. Refuses unless at
        least t valid signatures of survivors over the set this node signed came with the request (the
        aggregator told every signer the same U3), and refuses a request that names one node both ways (that
        would unmask its input), a node of U3 as dropped or one outside U3 as a survivor."""
        survivors, dropped = set(request.survivors), set(request.dropped)
        if not self.survivors:
            raise SecAggError("asked to reveal shares before signing the survivor set (no consistency check)")
        signed = survivors_bytes(self.context, self.survivors)
        valid = set()
        for n, signature in request.signatures.items():
            if n in self.survivors and n in self.verify_keys:
                try:
                    crypto.verify(self.verify_keys[n], signature, signed)
                except crypto.CryptoError:
                    continue
                valid.add(n)
        if len(valid) < self.params.threshold:
            raise SecAggError(f"only {len(valid)} valid signature(s) over the survivor set node {self.node} signed, "
                              f"below the threshold {self.params.threshold}: the aggregator may have told workers "
                              "different survivor sets; refusing to reveal shares")
        if survivors & dropped:
            raise SecAggError(f"node(s) {sorted(survivors & dropped)} asked for as both survivor and dropped: "
                              "refusing (it would reveal their input)")
        if survivors - self.survivors or dropped & self.survivors:
            raise SecAggError("the unmask request contradicts the survivor set that was signed: refusing")
        if self.node not in survivors:
            raise SecAggError(f"node {self.node} is not among the survivors asked")
        if len(survivors) < self.params.threshold:
            raise SecAggError(f"{len(survivors)} survivors are fewer than the threshold {self.params.threshold}")
        if dropped - self.masked_with or survivors - self.masked_with:
            raise SecAggError("the request names nodes that did not share keys with this node")
        return Reveal(self.node, {u: self.held[u][0] for u in sorted(survivors)},
                      {d: self.held[d][1] for d in sorted(dropped)})


@dataclass
class Collector:
    """The aggregator's side of one round: relays keys and shares, sums masked vectors, unmasks the sum.

    Each stage's membership can be fixed from outside (`fix_roster`, `fix_senders`, `fix_survivors`,
    `fix_signers`), as a stored decision says: replicas of the aggregator that each saw part of a round's
    messages then hold the same sets, and a message from outside a fixed set is refused."""

    context: bytes
    params: Resolved
    verify_keys: Mapping[int, bytes]
    length: int  # values per update (the masked vector carries one more: the sample count)
    roster: dict[int, Advertisement] = field(default_factory=dict)  # U1
    shares: dict[int, list[EncryptedShare]] = field(default_factory=dict)  # U2: source -> its shares
    total: np.ndarray | None = None
    contributed: set[int] = field(default_factory=set)  # whose masked vectors `total` holds
    survivors: frozenset[int] | None = None  # U3, once fixed for the consistency check
    checks: dict[int, bytes] = field(default_factory=dict)  # U4: node -> its signature over U3
    reveals: dict[int, Reveal] = field(default_factory=dict)
    fixed_roster: frozenset[int] | None = None
    fixed_senders: frozenset[int] | None = None
    fixed_signers: frozenset[int] | None = None

    def take_advertisement(self, ad: Advertisement) -> None:
        """Record a participant's keys (checked here too, so a forgery fails fast and alone)."""
        if ad.node not in self.verify_keys:
            raise SecAggError(f"node {ad.node} is not a shard of this round")
        if self.fixed_roster is not None and ad.node not in self.fixed_roster:
            raise SecAggError(f"node {ad.node}'s keys came after the roster went out")
        try:
            crypto.verify(self.verify_keys[ad.node], ad.signature,
                          signed_bytes(self.context, ad.node, ad.c_public, ad.s_public))
        except crypto.CryptoError:
            raise SecAggError(f"node {ad.node}'s keys are not signed by its assignment key") from None
        self.roster.setdefault(ad.node, ad)

    def roster_list(self) -> list[Advertisement]:
        """Stage 1's result for every participant; SecAggError if some node has fewer neighbours than t."""
        self._check(set(self.roster), "advertised keys")
        return [self.roster[n] for n in sorted(self.roster)]

    def fix_roster(self, nodes: Iterable[int]) -> None:
        """U1 is these nodes (the roster that went out)."""
        self.fixed_roster = frozenset(nodes)
        self.roster = {n: ad for n, ad in self.roster.items() if n in self.fixed_roster}

    def take_shares(self, source: int, shares: Sequence[EncryptedShare]) -> None:
        """Record one participant's encrypted shares (once)."""
        if source not in self.roster:
            raise SecAggError(f"node {source} sent shares without advertising keys")
        if self.fixed_senders is not None and source not in self.fixed_senders:
            raise SecAggError(f"node {source}'s shares came after they were forwarded")
        mine = neighbours(source, list(self.roster), self.params.num_shares)
        if any(s.source != source or s.destination not in mine - {source} for s in shares):
            raise SecAggError(f"node {source}'s shares name nodes outside its neighbourhood")
        self.shares.setdefault(source, list(shares))

    def forwarded(self, destination: int) -> list[EncryptedShare]:
        """Stage 2's result for one participant: the shares sent to it by U2."""
        return [s for source in sorted(self.shares) for s in self.shares[source] if s.destination == destination]

    def close_shares(self) -> None:
        """End stage 2; SecAggError if some node is left with fewer neighbours than t."""
        self._check(set(self.shares), "shared keys")

    def fix_senders(self, nodes: Iterable[int]) -> None:
        """U2 is these nodes (those whose shares were forwarded)."""
        self.fixed_senders = frozenset(nodes)
        self.shares = {n: s for n, s in self.shares.items() if n in self.fixed_senders}

    def check_masked(self, node: int, vector: np.ndarray) -> None:
        """SecAggError if `vector` cannot be node's masked input: a node outside U2, a vector of another form or
        with values outside the ring. (One that comes after U3 was fixed cannot be unmasked: `late`.)"""
        if node not in self.shares:
            raise SecAggError(f"node {node} sent a masked vector without sharing keys")
        expected = self.length + 1
        if vector.dtype != np.uint64 or vector.shape != (expected,):
            raise SecAggError(f"node {node}'s masked vector is {vector.dtype} {tuple(vector.shape)}, expected "
                              f"uint64 ({expected},)")
        if vector.size and int(vector.max()) >= self.params.modulus_range:
            raise SecAggError(f"node {node}'s masked vector has values outside the ring")

    def late(self, node: int) -> str | None:
        """Why node's masked vector, arriving now, cannot be in the sum (U3 was fixed without it), or None."""
        if self.survivors is not None and node not in self.survivors:
            return f"node {node}'s masked vector came after the survivors were fixed for unmasking"
        return None

    def take_masked(self, node: int, vector: np.ndarray) -> None:
        """Fold one masked vector into the collector's own sum in the ring (once per node)."""
        if node in self.contributed:
            return
        self.check_masked(node, vector)
        self.total = add_masked(self.total, vector, self.params.modulus_range)
        self.contributed.add(node)

    def fix_survivors(self, nodes: Iterable[int], *, checked: bool = True) -> list[int]:
        """Stage 4: U3 is these nodes (whose masked vectors the sum holds); the set every survivor is asked to
        sign. SecAggError if some node's threshold cannot hold (`checked` False: a stored decision, taken as is)."""
        survivors = frozenset(nodes)
        if checked:
            self._check(set(survivors), "sent masked vectors")
        self.survivors = survivors
        self.checks = {n: sig for n, sig in self.checks.items() if n in survivors}
        return sorted(survivors)

    def take_check(self, node: int, signature: bytes) -> None:
        """Record a survivor's signature over U3 (once); SecAggError if it does not verify."""
        if self.survivors is None or node not in self.survivors:
            raise SecAggError(f"node {node} signed a survivor set but is not a survivor")
        if self.fixed_signers is not None and node not in self.fixed_signers:
            raise SecAggError(f"node {node}'s signature came after the unmask requests went out")
        try:
            crypto.verify(self.verify_keys[node], signature, survivors_bytes(self.context, self.survivors))
        except crypto.CryptoError:
            raise SecAggError(f"node {node}'s signature over the survivor set does not verify") from None
        self.checks.setdefault(node, signature)

    def checked(self) -> bool:
        """Whether every survivor has signed U3."""
        return self.survivors is not None and set(self.checks) >= self.survivors

    def fix_signers(self, nodes: Iterable[int], *, checked: bool = True) -> None:
        """U4 is these nodes (those asked to unmask); SecAggError if they are fewer than t (`checked` False: a
        stored decision, taken as is)."""
        signers = frozenset(nodes)
        if checked and len(signers) < self.params.threshold:
            raise SecAggError(f"only {len(signers)} survivor(s) signed the survivor set, below the threshold "
                              f"{self.params.threshold}: the round cannot be unmasked")
        self.fixed_signers = signers
        self.checks = {n: sig for n, sig in self.checks.items() if n in signers}

    def unmask_request(self, node: int) -> UnmaskRequest:
        """What stage 5 asks signer `node`: its neighbours' b shares (U3) and s-key shares (U2 \\ U3), with the
        signatures over U3."""
        survivors = self.survivors if self.survivors is not None else frozenset(self.contributed)
        self._check(set(survivors), "sent masked vectors")
        mine = neighbours(node, list(self.roster), self.params.num_shares) & set(self.shares)
        return UnmaskRequest(tuple(sorted(mine & survivors)), tuple(sorted(mine - survivors)), dict(self.checks))

    def take_reveal(self, reveal: Reveal) -> None:
        """Record a survivor's shares (once)."""
        if self.survivors is None or reveal.node not in self.survivors:
            raise SecAggError(f"node {reveal.node} revealed shares but is not a survivor")
        self.reveals.setdefault(reveal.node, reveal)

    def ready(self) -> bool:
        """Whether every survivor's and every dropped node's secret has t shares."""
        try:
            self._gathered()
        except SecAggError:
            return False
        return True

    def _gathered(self) -> tuple[dict[int, dict[int, bytes]], dict[int, dict[int, bytes]]]:
        if self.survivors is None:
            raise SecAggError("the survivors were never fixed for unmasking")
        if len(self.checks) < self.params.threshold:
            raise SecAggError(f"only {len(self.checks)} survivor(s) signed the survivor set, below the threshold "
                              f"{self.params.threshold}: no shares were asked for")
        b: dict[int, dict[int, bytes]] = {u: {} for u in self.survivors}
        s: dict[int, dict[int, bytes]] = {d: {} for d in set(self.shares) - self.survivors}
        for reveal in self.reveals.values():
            for owner, share in reveal.b_shares.items():
                if owner in b:
                    b[owner][reveal.node] = share
            for owner, share in reveal.s_shares.items():
                if owner in s:
                    s[owner][reveal.node] = share
        short = [n for n, got in (*b.items(), *s.items()) if len(got) < self.params.threshold]
        if short:
            raise SecAggError(f"too few shares revealed to rebuild the secrets of node(s) {sorted(short)} "
                              f"(threshold {self.params.threshold})")
        return b, s

    def finish(self, total: np.ndarray | None = None, contributed: Iterable[int] | None = None
               ) -> tuple[np.ndarray, int, int]:
        """The weighted mean update (float64), the total samples and the number of contributions, of the masked
        sum `total` of the vectors of `contributed` (default: the collector's own sum), which must be U3."""
        if contributed is None:
            total, contributed = self.total, set(self.contributed)
        held = frozenset(contributed)
        if total is None:
            raise SecAggError("no masked vector was received")
        if self.survivors is not None and held != self.survivors:
            raise SecAggError(f"the sum holds the masked vectors of node(s) {sorted(held)}, the survivors fixed for "
                              f"unmasking are {sorted(self.survivors)}: the round cannot be unmasked exactly")
        p, b_shares, s_shares = self.params, *self._gathered()
        modulus, total = p.modulus_range, total.copy()
        for u in sorted(held):
            total -= mask(shamir.combine(b_shares[u], p.threshold), total.size, modulus)
        for d in sorted(s_shares):
            s_private = shamir.combine(s_shares[d], p.threshold)
            if crypto.public_key(s_private) != self.roster[d].s_public:
                raise SecAggError(f"the shares revealed for node {d} do not rebuild its key (a corrupt share)")
            for v in sorted(neighbours(d, list(self.roster), p.num_shares) & held):
                pair = pairwise_mask(s_private, self.roster[v].s_public, self.context, total.size, modulus)
                if v > d:
                    total -= pair
                else:
                    total += pair
        total = ring(total, modulus)
        samples = int(total[-1])
        if samples <= 0:
            raise SecAggError("the unmasked sample count is not positive (a corrupt contribution)")
        weighted_sum = dequantize_sum(total[:-1], len(held), p.clipping_range, p.quantization_range)
        return weighted_sum * (p.max_weight / samples), samples, len(held)

    def _check(self, active: set[int], what: str) -> None:
        for n in sorted(self.roster):
            have = len(neighbours(n, list(self.roster), self.params.num_shares) & active)
            if have < self.params.threshold:
                raise SecAggError(f"node {n} has {have} neighbours that {what}, below the reconstruction "
                                  f"threshold {self.params.threshold}: the round cannot be aggregated securely")
        if len(active) < 2:
            raise SecAggError(f"only {len(active)} participant(s) {what}: a sum of one is its update")


def add_masked(total: np.ndarray | None, vector: np.ndarray, modulus: int) -> np.ndarray:
    """`total + vector` in the ring (the first vector: a copy of it)."""
    return vector.copy() if total is None else ring(total + vector, modulus)
