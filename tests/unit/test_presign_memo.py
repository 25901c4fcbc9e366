"""A URL asked for again within the second it was signed in is the same URL, signed once (pure logic)."""

from __future__ import annotations

import datetime
from unittest import mock

from botocore.auth import S3SigV4QueryAuth
from botocore.credentials import ReadOnlyCredentials

from apiary.storage import presign

ENDPOINT = presign.Endpoint("http://h:1/b/", "us-east-1", "s3")
T0 = datetime.datetime(2026, 12, 1, 7, 0, 0, tzinfo=datetime.UTC)


class Clock:
    """time.time and botocore's clock, moved by hand."""

    def __init__(self, start: datetime.datetime) -> None:
        self.now = start.timestamp()

    def time(self) -> float:
        return self.now

    def datetime(self) -> datetime.datetime:
        return datetime.datetime.fromtimestamp(self.now, datetime.UTC)


def _signing(clock: Clock) -> tuple[mock._patch[mock.MagicMock], mock._patch[mock.MagicMock], mock.MagicMock]:
    """Patches for both clocks, and a spy on botocore's signer."""
    spy = mock.MagicMock(wraps=S3SigV4QueryAuth.add_auth)
    return (mock.patch("botocore.auth.get_current_datetime", side_effect=clock.datetime),
            mock.patch.object(presign.time, "time", side_effect=clock.time), spy)


def test_the_same_url_within_a_second_is_signed_once() -> None:
    # Prepare
    clock = Clock(T0)
    presigner = presign.Presigner(ENDPOINT, lambda: ReadOnlyCredentials("A", "s", None))
    botocore_clock, our_clock, spy = _signing(clock)
    with botocore_clock, our_clock, mock.patch.object(S3SigV4QueryAuth, "add_auth", autospec=True, side_effect=spy):
        # Execute
        first = presigner.presign("GET", "jobs/j/global", 600)
        clock.now += 0.9
        again = presigner.presign("GET", "jobs/j/global", 600)
        clock.now += 0.2  # the next second
        later = presigner.presign("GET", "jobs/j/global", 600)

    # Assert: one signature for the first two, a fresh one (dated the new second) after.
    assert again == first and later != first
    assert "X-Amz-Date=20261201T070001Z" in later
    assert spy.call_count == 2


def test_any_difference_in_what_is_asked_signs_anew() -> None:
    # Prepare
    clock = Clock(T0)
    creds = [ReadOnlyCredentials("A", "s", None)]
    presigner = presign.Presigner(ENDPOINT, lambda: creds[0])
    botocore_clock, our_clock, _ = _signing(clock)
    with botocore_clock, our_clock:
        # Execute
        urls = {presigner.presign("GET", "k", 600), presigner.presign("PUT", "k", 600),
                presigner.presign("GET", "k2", 600), presigner.presign("GET", "k", 601),
                presigner.presign("PUT", "k", 600, headers={"x-amz-meta-sha256": "ab"})}
        creds[0] = ReadOnlyCredentials("A", "rotated", "token")
        urls.add(presigner.presign("GET", "k", 600))

    # Assert
    assert len(urls) == 6
