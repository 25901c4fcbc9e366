"""Presigned S3 URLs (AWS Signature Version 4, query-string form) without botocore's request pipeline.

botocore's `generate_presigned_url` builds and signs a whole request: about 1.5 ms of CPU each on
our machines, and the scheduler presigns four URLs per shard per round. Signing a URL is a few
HMACs. The parts that depend on the endpoint (scheme, host, path or virtual-host addressing, the
region and service in the credential scope) are taken once from a URL botocore presigned itself,
so both agree on where an object lives; tests check that the signatures are byte-identical.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlsplit

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


@dataclass(frozen=True)
class Credentials:
    """What signs a URL: the access key, its secret and, for temporary credentials, the session token."""

    access_key: str
    secret_key: str
    token: str | None = None


@dataclass(frozen=True)
class Endpoint:
    """Where the bucket's objects live, as botocore addresses them: `base` + quoted key."""

    scheme: str
    host: str  # with the port when it is not the scheme's default
    base_path: str  # "/bucket/" (path style) or "/" (virtual host)
    region: str
    service: str

    @classmethod
    def from_presigned(cls, url: str, key: str) -> Endpoint:
        """The endpoint of `url`, a URL botocore presigned for the object `key`."""
        parts = urlsplit(url)
        quoted = _quote_path(key)
        if not parts.path.endswith(quoted):
            raise ValueError(f"presigned URL path {parts.path!r} does not end with the key {quoted!r}")
        scope = dict(parse_qsl(parts.query))["X-Amz-Credential"].split("/")
        return cls(scheme=parts.scheme, host=parts.netloc, base_path=parts.path[: -len(quoted)],
                   region=scope[2], service=scope[3])


def _quote_path(key: str) -> str:
    return quote(key, safe="/~")


def _quote(value: str) -> str:
    return quote(value, safe="-_.~")


class Presigner:
    """Signs GET and PUT URLs for objects under one endpoint; the signing key is derived once a day."""

    def __init__(self, endpoint: Endpoint, credentials: Callable[[], Credentials]) -> None:
        self.endpoint = endpoint
        self._credentials = credentials
        self._signing_key: tuple[str, str, bytes] | None = None  # (date, secret, key)

    def _key_for(self, date: str, secret: str) -> bytes:
        cached = self._signing_key
        if cached is not None and cached[0] == date and cached[1] == secret:
            return cached[2]
        key = _hmac(("AWS4" + secret).encode(), date)
        for part in (self.endpoint.region, self.endpoint.service, "aws4_request"):
            key = _hmac(key, part)
        self._signing_key = (date, secret, key)
        return key

    def presign(self, method: str, key: str, expires: int, now: float | None = None,
                headers: dict[str, str] | None = None) -> str:
        """A URL that lets its holder `method` (GET or PUT) the object `key` for `expires` seconds;
        `headers` (such as `x-amz-meta-sha256`) are signed too, and the request must send them."""
        signed = {"host": self.endpoint.host, **{k.lower(): " ".join(v.split()) for k, v in (headers or {}).items()}}
        names = ";".join(sorted(signed))
        creds = self._credentials()
        stamp = time.gmtime(time.time() if now is None else now)
        amz_date = time.strftime("%Y%m%dT%H%M%SZ", stamp)
        date = amz_date[:8]
        e = self.endpoint
        scope = f"{date}/{e.region}/{e.service}/aws4_request"
        params = {
            "X-Amz-Algorithm": ALGORITHM,
            "X-Amz-Credential": f"{creds.access_key}/{scope}",
            "X-Amz-Date": amz_date,
            "X-Amz-Expires": str(int(expires)),
            "X-Amz-SignedHeaders": names,
        }
        if creds.token:
            params["X-Amz-Security-Token"] = creds.token
        query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(params.items()))
        path = e.base_path + _quote_path(key)
        canonical_headers = "".join(f"{name}:{signed[name]}\n" for name in sorted(signed))
        canonical = f"{method}\n{path}\n{query}\n{canonical_headers}\n{names}\n{UNSIGNED_PAYLOAD}"
        to_sign = f"{ALGORITHM}\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._key_for(date, creds.secret_key), to_sign.encode(), hashlib.sha256).hexdigest()
        return f"{e.scheme}://{e.host}{path}?{query}&X-Amz-Signature={signature}"


def _hmac(key: bytes, message: str) -> bytes:
    return hmac.new(key, message.encode(), hashlib.sha256).digest()
