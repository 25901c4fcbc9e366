"""Presigned S3 URLs signed by botocore's SigV4 query signer, without the client's request pipeline.

`generate_presigned_url` runs botocore's whole request pipeline (parameter validation, endpoint
rules, event hooks) for every URL: about 0.2 ms of CPU each, and the scheduler presigns five URLs
per shard per round. Where an object lives (scheme, host, path or virtual-host addressing, the
region of the credential scope) is taken once from a URL botocore presigned itself; every URL is
then signed by `S3SigV4QueryAuth`, the signer that pipeline ends in, so both sign alike.

That signer still costs ~70 us a URL, and a round's assignments ask for the same URL many times (every
shard's carries the round's global weights and the job's end marker): a URL asked for again within the
same second is the one already signed, which is what signing it again would give (SigV4 dates to the
second).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlsplit

from botocore.auth import S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import ReadOnlyCredentials


def quote_key(key: str) -> str:
    """A key as it stands in an S3 URL's path (botocore quotes it alike)."""
    return quote(key, safe="/~")


@dataclass(frozen=True)
class Endpoint:
    """Where the bucket's objects live, as botocore addresses them: `base_url` + quoted key."""

    base_url: str  # "http://host:port/bucket/" (path style) or "https://bucket.s3.amazonaws.com/"
    region: str
    service: str

    @classmethod
    def from_presigned(cls, url: str, key: str) -> Endpoint:
        """The endpoint of `url`, a URL botocore presigned for the object `key`."""
        parts = urlsplit(url)
        quoted = quote_key(key)
        if not parts.path.endswith(quoted):
            raise ValueError(f"presigned URL path {parts.path!r} does not end with the key {quoted!r}")
        scope = dict(parse_qsl(parts.query))["X-Amz-Credential"].split("/")
        base = f"{parts.scheme}://{parts.netloc}{parts.path[: -len(quoted)]}"
        return cls(base_url=base, region=scope[2], service=scope[3])


class Presigner:
    """Signs GET and PUT URLs for objects under one endpoint."""

    def __init__(self, endpoint: Endpoint, credentials: Callable[[], ReadOnlyCredentials]) -> None:
        self.endpoint = endpoint
        # Called for every URL: refreshable credentials freeze (and refresh when due) there.
        self._credentials = credentials
        self._second = 0  # the second the URLs in `_signed` were signed in
        self._signed: dict[tuple[object, ...], str] = {}

    def presign(self, method: str, key: str, expires: int, headers: Mapping[str, str] | None = None) -> str:
        """A URL that lets its holder `method` (GET or PUT) the object `key` for `expires` seconds;
        `headers` (such as `x-amz-meta-sha256`) are signed too, and the request must send them."""
        credentials = self._credentials()
        asked = (method, key, expires, tuple(sorted((headers or {}).items())), credentials)
        now = int(time.time())
        if now != self._second:
            self._second, self._signed = now, {}
        url = self._signed.get(asked)
        if url is None:
            # Dated `now`, or a later second if signing crossed into it (then no later call is in `now`).
            url = self._signed[asked] = self._sign(method, key, expires, headers, credentials)
        return url

    def _sign(self, method: str, key: str, expires: int, headers: Mapping[str, str] | None,
              credentials: ReadOnlyCredentials) -> str:
        request = AWSRequest(method=method, url=self.endpoint.base_url + quote_key(key), headers=dict(headers or {}))
        S3SigV4QueryAuth(credentials, self.endpoint.service, self.endpoint.region, expires=expires).add_auth(request)
        return str(request.url)
