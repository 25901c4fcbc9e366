"""Secure aggregation's protocol (apiary.secagg) on its own: the unmasked mean equals the plain weighted mean
within the stated quantisation bound, dropouts before and after masking are recovered from shares, masked
vectors do not correlate with their updates, and forged keys, altered shares or a request to unmask one node
both ways are refused."""

from __future__ import annotations

import numpy as np
import pytest

from apiary.secagg import crypto, shamir
from apiary.secagg.masks import mask
from apiary.secagg.protocol import Collector, EncryptedShare, Participant, SecAggError, UnmaskRequest, neighbours
from apiary.secagg.quantize import dequantize_sum, mean_error_bound, quantize, step
from apiary.secagg.settings import Resolved, SecureAggregation

CONTEXT = b"job-1/round-3/attempt-0"
LENGTH = 2000


def round_of(k: int, num_shares: int | float = 1, threshold: int | float = 0.5, **settings: float
             ) -> tuple[Resolved, dict[int, Participant], Collector]:
    params = SecureAggregation(num_shares=num_shares, reconstruction_threshold=threshold, **settings).resolved(k)
    signing = {n: crypto.new_signing_key() for n in range(1, k + 1)}
    verify = {n: crypto.verify_key(key) for n, key in signing.items()}
    participants = {n: Participant(n, CONTEXT, params, signing[n], verify) for n in signing}
    return params, participants, Collector(CONTEXT, params, verify, LENGTH)


def run(participants: dict[int, Participant], collector: Collector, updates: dict[int, np.ndarray],
        samples: dict[int, int], *, drop_before_masking: set[int] = frozenset(),  # type: ignore[assignment]
        drop_after_masking: set[int] = frozenset()) -> tuple[np.ndarray, int, int, dict[int, np.ndarray]]:  # type: ignore[assignment]
    for p in participants.values():
        collector.take_advertisement(p.advertise())
    roster = collector.roster_list()
    for n, p in participants.items():
        collector.take_shares(n, p.share_keys(roster))
    collector.close_shares()
    uploaded = {}
    for n, p in participants.items():
        if n in drop_before_masking:
            continue
        vector, _ = p.masked_input(collector.forwarded(n), updates[n], samples[n], np.random.default_rng(n))
        collector.take_masked(n, vector)
        uploaded[n] = vector
    survivors = collector.fix_survivors(collector.contributed)
    signers = sorted(set(survivors) - drop_after_masking)
    for n in signers:
        collector.take_check(n, participants[n].check(survivors))
    for n in signers:
        collector.take_reveal(participants[n].unmask(collector.unmask_request(n)))
    mean, total, contributors = collector.finish()
    return mean, total, contributors, uploaded


def plain_mean(updates: dict[int, np.ndarray], samples: dict[int, int], nodes: set[int]) -> np.ndarray:
    return sum(updates[n] * samples[n] for n in nodes) / sum(samples[n] for n in nodes)


def data(k: int, seed: int = 0) -> tuple[dict[int, np.ndarray], dict[int, int]]:
    rng = np.random.default_rng(seed)
    return ({n: rng.normal(0, 0.5, LENGTH) for n in range(1, k + 1)},
            {n: int(rng.integers(10, 1000)) for n in range(1, k + 1)})


@pytest.mark.parametrize("k", [4, 16])
def test_the_unmasked_mean_is_the_weighted_mean_within_the_bound(k: int) -> None:
    params, participants, collector = round_of(k)
    updates, samples = data(k)

    mean, total, contributors, _ = run(participants, collector, updates, samples)

    bound = params.error_bound(contributors, total)
    assert (contributors, total) == (k, sum(samples.values()))
    assert np.abs(mean - plain_mean(updates, samples, set(samples))).max() <= bound
    assert bound == k * (16.0 / 4194304) * 1000 / total


def test_the_bound_is_tight_enough_to_fail_a_wrong_sum() -> None:
    # Prepare: a bound that would pass anything is no test: one step more on one value must exceed it.
    params, participants, collector = round_of(4)
    updates, samples = data(4)
    mean, total, contributors, _ = run(participants, collector, updates, samples)
    plain = plain_mean(updates, samples, set(samples))

    off = mean.copy()
    off[0] += 2 * params.error_bound(contributors, total)

    assert np.abs(off - plain).max() > params.error_bound(contributors, total)


def test_stochastic_rounding_is_unbiased_and_within_one_step() -> None:
    values = np.full(200_000, 0.3)

    q, clipped = quantize(values, 8.0, 2**22, np.random.default_rng(1))

    back = dequantize_sum(q, 1, 8.0, 2**22)
    assert clipped == 0
    assert np.abs(back - values).max() < step(8.0, 2**22)
    assert abs(back.mean() - 0.3) < step(8.0, 2**22) / 50  # floor alone would be biased by about half a step


def test_a_worker_dropping_after_masking_is_recovered_from_shares() -> None:
    _, participants, collector = round_of(5, threshold=3)
    updates, samples = data(5, seed=2)

    mean, total, contributors, _ = run(participants, collector, updates, samples, drop_after_masking={2})

    assert contributors == 5 and total == sum(samples.values())
    assert np.abs(mean - plain_mean(updates, samples, set(samples))).max() <= mean_error_bound(
        5, total, 8.0, 2**22, 1000.0)


def test_a_worker_dropping_before_masking_has_its_pairwise_masks_removed() -> None:
    params, participants, collector = round_of(6, num_shares=5, threshold=3)
    updates, samples = data(6, seed=3)

    mean, total, contributors, _ = run(participants, collector, updates, samples, drop_before_masking={4},
                                       drop_after_masking={1})

    kept = set(samples) - {4}
    assert contributors == 5 and total == sum(samples[n] for n in kept)
    assert np.abs(mean - plain_mean(updates, samples, kept)).max() <= params.error_bound(contributors, total)


def test_too_many_dropouts_fail_the_round_rather_than_unmask_wrongly() -> None:
    _, participants, collector = round_of(4, threshold=3)
    updates, samples = data(4)

    with pytest.raises(SecAggError, match="threshold"):
        run(participants, collector, updates, samples, drop_before_masking={1, 2})


def test_no_masked_vector_correlates_with_its_update() -> None:
    _, participants, collector = round_of(4)
    updates, samples = data(4, seed=4)

    _, _, _, uploaded = run(participants, collector, updates, samples)

    for n, vector in uploaded.items():
        plain, _ = quantize(updates[n] * samples[n] / 1000, 8.0, 2**22, np.random.default_rng(n))
        correlation = np.corrcoef(vector[:-1].astype(np.float64), plain.astype(np.float64))[0, 1]
        assert abs(correlation) < 0.1, (n, correlation)  # ~ 1/sqrt(2000) for independent vectors
        assert int(vector[-1]) != samples[n]  # the sample count is masked too
    # The same check sees a correlation where there is one: an unmasked vector correlates fully.
    plain, _ = quantize(updates[1] * samples[1] / 1000, 8.0, 2**22, np.random.default_rng(1))
    assert np.corrcoef(plain.astype(np.float64), updates[1])[0, 1] > 0.99


def test_a_substituted_key_is_refused_by_every_participant() -> None:
    _, participants, collector = round_of(4)
    for p in participants.values():
        collector.take_advertisement(p.advertise())
    roster = collector.roster_list()
    impostor = Participant(3, CONTEXT, participants[3].params, crypto.new_signing_key(), participants[3].verify_keys)
    forged = [impostor.advertise() if ad.node == 3 else ad for ad in roster]

    with pytest.raises(SecAggError, match="node 3's keys are not signed by its assignment key"):
        participants[1].share_keys(forged)
    with pytest.raises(SecAggError, match="not signed"):
        Collector(CONTEXT, participants[1].params, participants[1].verify_keys, LENGTH).take_advertisement(forged[2])


def test_keys_signed_for_another_round_are_refused() -> None:
    _, participants, _ = round_of(3)
    other_round = Participant(2, b"job-1/round-4/attempt-0", participants[2].params, b"", {})
    other_round.signing_key = participants[2].signing_key
    stale = other_round.advertise()
    roster = [participants[1].advertise(), stale, participants[3].advertise()]

    with pytest.raises(SecAggError, match="node 2"):
        participants[1].share_keys(roster)


def test_an_altered_share_does_not_decrypt() -> None:
    _, participants, collector = round_of(3)
    for p in participants.values():
        collector.take_advertisement(p.advertise())
    roster = collector.roster_list()
    for n, p in participants.items():
        collector.take_shares(n, p.share_keys(roster))
    share = collector.forwarded(1)[0]
    flipped = EncryptedShare(share.source, share.destination,
                             share.ciphertext[:-1] + bytes([share.ciphertext[-1] ^ 1]))

    with pytest.raises(crypto.CryptoError, match="does not decrypt"):
        participants[1].masked_input([flipped], np.zeros(LENGTH), 10)


def test_a_request_to_unmask_one_node_both_ways_is_refused() -> None:
    _, participants, collector = round_of(4)
    updates, samples = data(4)
    for p in participants.values():
        collector.take_advertisement(p.advertise())
    roster = collector.roster_list()
    for n, p in participants.items():
        collector.take_shares(n, p.share_keys(roster))
    for n, p in participants.items():
        p.masked_input(collector.forwarded(n), updates[n], samples[n])
    signatures = {n: participants[n].check((1, 2, 3, 4)) for n in (1, 2)}

    with pytest.raises(SecAggError, match="both survivor and dropped"):
        participants[1].unmask(UnmaskRequest(survivors=(1, 2, 3), dropped=(2,), signatures=signatures))


def masked_round(k: int, threshold: int) -> tuple[dict[int, Participant], Collector]:
    """A round of k nodes up to their masked inputs, every vector in the collector's sum."""
    _, participants, collector = round_of(k, threshold=threshold)
    updates, samples = data(k)
    for p in participants.values():
        collector.take_advertisement(p.advertise())
    roster = collector.roster_list()
    for n, p in participants.items():
        collector.take_shares(n, p.share_keys(roster))
    collector.close_shares()
    for n, p in participants.items():
        collector.take_masked(n, p.masked_input(collector.forwarded(n), updates[n], samples[n])[0])
    return participants, collector


def test_an_aggregator_telling_workers_different_survivor_sets_gets_no_reveal() -> None:
    # The lie SecAgg's consistency check stops: nodes 1 and 2 are told node 4 survived (to reveal its self-mask
    # seed), node 3 that it dropped (to reveal its mask key): both secrets would unmask node 4's input.
    participants, _ = masked_round(4, threshold=3)
    told = {1: (1, 2, 3, 4), 2: (1, 2, 3, 4), 3: (1, 2, 3)}
    signatures = {n: participants[n].check(told[n]) for n in told}
    with pytest.raises(SecAggError, match="did not survive"):
        participants[4].check((1, 2, 3))  # node 4 itself is told it dropped: it signs nothing
    requests = {1: UnmaskRequest((1, 2, 3, 4), (), signatures), 2: UnmaskRequest((1, 2, 3, 4), (), signatures),
                3: UnmaskRequest((1, 2, 3), (4,), signatures)}

    refused = []
    for n, request in requests.items():
        with pytest.raises(SecAggError, match="different survivor sets") as raised:
            participants[n].unmask(request)
        refused.append(str(raised.value))

    assert len(refused) == 3  # nobody reveals a share: neither set gathered t = 3 signatures


def test_the_consistency_check_refuses_forged_foreign_and_contradicting_signatures() -> None:
    participants, collector = masked_round(4, threshold=3)
    survivors = collector.fix_survivors(collector.contributed)
    signatures = {n: participants[n].check(survivors) for n in (1, 2, 3)}
    other_round = crypto.sign(participants[2].signing_key, b"apiary secagg survivors|another round|")
    forged = {1: signatures[1], 2: other_round, 3: signatures[3][:-1] + bytes([signatures[3][-1] ^ 1])}

    with pytest.raises(SecAggError, match="only 1 valid signature"):
        participants[1].unmask(UnmaskRequest((1, 2, 3, 4), (), forged))
    with pytest.raises(SecAggError, match="does not verify"):
        collector.take_check(2, other_round)
    with pytest.raises(SecAggError, match="two different survivor sets"):
        participants[1].check((1, 2, 3))
    with pytest.raises(SecAggError, match="contradicts the survivor set"):
        participants[1].unmask(UnmaskRequest((1, 2, 3), (4,), signatures))  # 4 survived in the set signed
    for n in (1, 2, 3):
        collector.take_check(n, signatures[n])
    reveal = participants[1].unmask(collector.unmask_request(1))
    assert set(reveal.b_shares) == {1, 2, 3, 4} and not reveal.s_shares


def test_the_sum_must_hold_exactly_the_survivors_fixed_for_unmasking() -> None:
    _, collector = masked_round(3, threshold=2)
    collector.fix_survivors({1, 2})  # node 3's vector is in the sum, but the survivors were fixed without it

    assert collector.late(3) == "node 3's masked vector came after the survivors were fixed for unmasking"
    assert collector.late(2) is None
    with pytest.raises(SecAggError, match="cannot be unmasked exactly"):
        collector.finish()


def test_a_sample_count_over_max_weight_is_refused_on_the_worker() -> None:
    _, participants, collector = round_of(3, max_weight=100.0)
    for p in participants.values():
        collector.take_advertisement(p.advertise())
    roster = collector.roster_list()
    for n, p in participants.items():
        collector.take_shares(n, p.share_keys(roster))

    with pytest.raises(SecAggError, match=r"raise secure_aggregation\.max_weight"):
        participants[1].masked_input(collector.forwarded(1), np.zeros(LENGTH), 101)


def test_a_malformed_masked_vector_is_refused_without_touching_the_sum() -> None:
    _, participants, collector = round_of(3)
    for p in participants.values():
        collector.take_advertisement(p.advertise())
    roster = collector.roster_list()
    for n, p in participants.items():
        collector.take_shares(n, p.share_keys(roster))

    with pytest.raises(SecAggError, match="expected uint64"):
        collector.take_masked(1, np.zeros(LENGTH + 1, dtype=np.float32))
    with pytest.raises(SecAggError, match="outside the ring"):
        collector.take_masked(1, np.full(LENGTH + 1, 2**40, dtype=np.uint64))
    assert collector.total is None and not collector.contributed


def test_shamir_rebuilds_from_any_threshold_and_not_from_fewer() -> None:
    secret = bytes(range(32))
    shares = shamir.split(secret, 3, [1, 2, 3, 4, 5])

    assert shamir.combine({x: shares[x] for x in (2, 4, 5)}, 3) == secret
    assert shamir.combine({x: shares[x] for x in (1, 3, 5)}, 3) == secret
    with pytest.raises(ValueError, match="2 shares cannot rebuild"):
        shamir.combine({x: shares[x] for x in (1, 2)}, 3)
    # Two shares interpolated as if they were enough give something else (overwhelmingly not a 32-byte value).
    with pytest.raises(ValueError):
        assert shamir.combine({x: shares[x] for x in (1, 2)}, 2) != secret


def test_masks_are_uniform_in_the_ring_and_pairs_agree() -> None:
    a, b = crypto.new_private_key(), crypto.new_private_key()

    ab = crypto.agree(a, crypto.public_key(b), b"m", CONTEXT)
    ba = crypto.agree(b, crypto.public_key(a), b"m", CONTEXT)
    values = mask(ab, 100_000, 2**16)

    assert ab == ba and ab != crypto.agree(a, crypto.public_key(b), b"m", b"another round")
    assert values.max() < 2**16 and abs(values.mean() / 2**16 - 0.5) < 0.01


def test_neighbourhoods_are_a_symmetric_ring() -> None:
    nodes = list(range(1, 10))

    hoods = {n: neighbours(n, nodes, 5) for n in nodes}

    assert all(len(h) == 5 and n in h for n, h in hoods.items())
    assert all(n in hoods[v] for n, h in hoods.items() for v in h)
