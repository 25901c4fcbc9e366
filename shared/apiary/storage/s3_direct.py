"""Whole small objects read and written by presigned URL, through a boto3 client's own connection pool.

A `get_object` or `put_object` runs botocore's whole request pipeline (parameter validation, endpoint
rules, event hooks, checksums, response parsing): about twice the CPU of the request itself, which
counts where the aggregator reads every contribution of every round and writes each round's average.
Here the request is signed by `apiary.storage.presign` and sent by the client's HTTP session (the same
pool, TLS settings, proxies and timeouts as the client's own calls); failures come out as the client's
would (a `ClientError` parsed by botocore from the S3 error answer, botocore's connection errors) after
as many attempts as the client makes, so callers judge them alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from botocore.awsrequest import AWSRequest, AWSResponse
from botocore.exceptions import BotoCoreError, ClientError, IncompleteReadError
from botocore.parsers import create_parser

from apiary.backoff import Backoff

OCTET_STREAM = "application/octet-stream"


def _where(url: str) -> str:
    """A URL without its query: a presigned signature is a credential and stays out of messages."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


class DirectRequests:
    """GET and PUT of whole objects by presigned URL through `client`'s HTTP session, each retried through
    the failures `transient` names, `backoff.attempts` times in all."""

    def __init__(self, client: Any, transient: Callable[[BaseException], bool], backoff: Backoff) -> None:
        # The session botocore sends the client's own requests through (one pool per client).
        self._session = client._endpoint.http_session
        self._model = client.meta.service_model
        self._parser = create_parser(self._model.protocol)
        self._transient, self._backoff = transient, backoff

    def get(self, url: str) -> tuple[bytes, Mapping[str, str]]:
        """The object's bytes and the response's headers."""
        response = self._send("GetObject", AWSRequest(method="GET", url=url))
        return response.content, response.headers

    def put(self, url: str, data: bytes, headers: Mapping[str, str]) -> None:
        """Store `data`, sending `headers` (those the URL was signed with among them)."""
        request = AWSRequest(method="PUT", url=url, data=data, headers={**headers, "Content-Type": OCTET_STREAM})
        self._send("PutObject", request)

    def _send(self, operation: str, request: AWSRequest) -> AWSResponse:
        failures = 0
        while True:
            try:
                return self._once(operation, request)
            except (ClientError, BotoCoreError) as e:
                failures += 1
                if failures >= self._backoff.attempts or not self._transient(e):
                    raise
                time.sleep(self._backoff.delay(failures))

    def _once(self, operation: str, request: AWSRequest) -> AWSResponse:
        try:
            response: AWSResponse = self._session.send(request.prepare())
        except BotoCoreError as e:
            if "endpoint_url" not in e.kwargs:
                raise
            raise type(e)(**{**e.kwargs, "endpoint_url": _where(str(request.url))}) from None
        if response.status_code >= 300:
            raise self._error(operation, response)
        expected = response.headers.get("Content-Length")
        if request.method == "GET" and expected is not None and int(expected) != len(response.content):
            raise IncompleteReadError(actual_bytes=len(response.content), expected_bytes=int(expected))
        return response

    def _error(self, operation: str, response: AWSResponse) -> ClientError:
        """The ClientError botocore would raise for this answer (its S3 error code, status and message)."""
        shape = self._model.operation_model(operation).output_shape
        parsed = self._parser.parse({"status_code": response.status_code, "headers": response.headers,
                                     "body": response.content}, shape)
        return ClientError(parsed, operation)
