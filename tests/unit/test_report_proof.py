"""Who may settle a shard: the assignment's one-time secret, the shard's own upload and the broker's user."""

from __future__ import annotations

from typing import Any

from apiary import keys, proof
from apiary.bus.identity import worker_user
from apiary.component import to_json
from apiary.contracts import ObjectRef, WorkerDone, WorkerFailed, WorkerHeartbeat, WorkerProgress
from apiary.status import ContributionStatus
from services.aggregator.decisions import Verdict, judge_sender
from services.tracker import forgery

SECRET = proof.new_secret()


def _round(digests: dict[int, str]) -> dict[str, Any]:
    return {"secret_digests": to_json({str(k): v for k, v in digests.items()})}


def _done(*, secret: str = SECRET, key: str | None = None, worker: str = "w1") -> WorkerDone:
    ref = ObjectRef(key=key or keys.contribution("j", 1, 1, 0), size=1, sha256="0" * 64)
    return WorkerDone(job_id="j", round=1, attempt=1, worker_id=worker, shard=0, result=ref, samples=1, secret=secret)


def test_a_secret_proves_only_itself_and_a_missing_one_proves_nothing() -> None:
    other = proof.new_secret()

    assert other != SECRET and len(SECRET) >= 40
    assert proof.proves(SECRET, proof.digest(SECRET))
    assert not proof.proves(other, proof.digest(SECRET))
    assert not proof.proves("", proof.digest(SECRET))
    assert not proof.proves(SECRET, None)
    assert proof.progress_token(SECRET) != SECRET
    assert proof.proves(proof.progress_token(SECRET), proof.digest(proof.progress_token(SECRET)))
    assert not proof.proves(proof.progress_token(SECRET), proof.digest(SECRET))


def test_one_rule_judges_every_report_the_secret_first_then_the_broker_user() -> None:
    expected = proof.digest(SECRET)

    genuine = proof.judge("w1", worker_user("w1"), SECRET, expected, about="shard 0")
    wrong = proof.judge("w1", None, "guess", expected, about="shard 0")
    missing = proof.judge("w1", "guest", None, expected, what=proof.TOKEN, about="the task")
    other_user = proof.judge("w1", worker_user("w2"), SECRET, expected, about="shard 0")
    both = proof.judge("w1", worker_user("w2"), None, expected, about="shard 0")
    before_secrets = proof.judge("w1", None, None, None, about="shard 0")
    unmatchable = proof.judge("w1", None, SECRET, proof.UNMATCHABLE, about="shard 0")

    assert genuine is None and before_secrets is None
    assert wrong == "a wrong assignment secret for shard 0"
    assert missing == "no progress token for the task"
    assert other_user == "sent by worker 'w2''s broker user, not by worker 'w1'"
    assert both == "no assignment secret for shard 0"
    assert unmatchable == "a wrong assignment secret for shard 0"
    assert proof.judge("w1", worker_user("w2"), None, None, about="shard 0") == other_user


def test_the_genuine_report_passes() -> None:
    assert judge_sender(_done(), _round({0: proof.digest(SECRET)}), None) is None
    assert judge_sender(_done(), _round({0: proof.digest(SECRET)}), worker_user("w1")) is None


def test_a_wrong_or_missing_secret_is_forged_and_a_failure_alike() -> None:
    digests = _round({0: proof.digest(SECRET)})
    failed = WorkerFailed(job_id="j", round=1, worker_id="w1", shard=0, error="boom", secret="guess")

    assert judge_sender(_done(secret="guess"), digests, None) == Verdict(
        ContributionStatus.FORGED, "a wrong assignment secret for shard 0")
    assert judge_sender(_done(secret=""), digests, None) == Verdict(
        ContributionStatus.FORGED, "no assignment secret for shard 0")
    assert judge_sender(failed, digests, None) == Verdict(
        ContributionStatus.FORGED, "a wrong assignment secret for shard 0")
    assert judge_sender(_done(), _round({1: proof.digest(SECRET)}), None) is not None  # another shard's


def test_another_object_or_another_broker_user_is_forged() -> None:
    digests = _round({0: proof.digest(SECRET)})

    elsewhere = judge_sender(_done(key="jobs/j/elsewhere.safetensors"), digests, None)
    other_user = judge_sender(_done(), digests, worker_user("w2"))
    own_user = judge_sender(_done(), digests, worker_user("w1"))
    shared_user = judge_sender(_done(), digests, "guest")

    assert elsewhere is not None and elsewhere.status is ContributionStatus.FORGED
    assert "is not this shard's upload" in elsewhere.reason
    assert other_user == Verdict(ContributionStatus.FORGED, "sent by worker 'w2''s broker user, not by worker 'w1'")
    assert own_user is None and shared_user is None


def test_a_round_that_announced_no_digest_for_the_shard_believes_no_secret() -> None:
    assert judge_sender(_done(), _round({}), None) == Verdict(
        ContributionStatus.FORGED, "a wrong assignment secret for shard 0")
    assert judge_sender(_done(secret=""), _round({}), None) == Verdict(
        ContributionStatus.FORGED, "no assignment secret for shard 0")


def test_the_tracker_believes_a_progress_report_or_heartbeat_only_with_the_shards_token() -> None:
    token = proof.progress_token(SECRET)
    row = {"secret_digest": proof.digest(SECRET), "progress_digest": proof.digest(token)}
    progress = WorkerProgress(job_id="j", round=1, attempt=1, shard=0, worker_id="w1", token=token)
    heartbeat = WorkerHeartbeat(worker_id="w1", state="training", job_id="j", round=1, shard=0, token="guess")
    failed = WorkerFailed(job_id="j", round=1, attempt=1, shard=0, worker_id="w1", error="x", secret="")

    assert forgery.judge(progress, row, worker_user("w1")) is None
    assert forgery.judge(progress.model_copy(update={"token": SECRET}), row, None) == \
        "a wrong progress token for shard 0"
    assert forgery.judge(heartbeat, row, None) == "a wrong progress token for shard 0"
    assert forgery.judge(failed, row, None) == \
        "no assignment secret for shard 0"
    assert forgery.judge(_done(), row, None) is None
    assert forgery.judge(WorkerHeartbeat(worker_id="w1", state="idle"), None, worker_user("w2")) == \
        "sent by worker 'w2''s broker user, not by worker 'w1'"
    assert forgery.judge(progress, None, None) is None  # a shard unknown here
    unannounced = {"secret_digest": "", "progress_digest": ""}  # a round.start that announced no digests
    assert forgery.judge(progress, unannounced, None) == "a wrong progress token for shard 0"
    assert forgery.shard_of(heartbeat.model_copy(update={"state": "idle"})) is None
