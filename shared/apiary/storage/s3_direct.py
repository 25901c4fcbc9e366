"""Whole small objects read and written by presigned URL, through an HTTP session set up as the client's own.

A `get_object` or `put_object` runs botocore's whole request pipeline (parameter validation, endpoint
rules, event hooks, checksums, response parsing): about twice the CPU of the request itself, which
counts where the aggregator reads every contribution of every round and writes each round's average.
Here the request is signed by `apiary.storage.presign` and sent by botocore's own HTTP session class, made
from the client's public configuration (the same TLS settings, proxies, timeouts and pool size as its own
calls, in a pool of its own); failures come out as the client's would (a `ClientError` parsed by botocore
from the S3 error answer, botocore's connection errors) after as many attempts as the client makes, with
the same jittered waits (`apiary.backoff`), so callers judge them alike.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from botocore.awsrequest import AWSRequest, AWSResponse
from botocore.exceptions import BotoCoreError, ClientError, IncompleteReadError
from botocore.httpsession import URLLib3Session
from botocore.parsers import create_parser
from botocore.utils import get_environ_proxies

from apiary.backoff import Backoff, retry

OCTET_STREAM = "application/octet-stream"


def _where(url: str) -> str:
    """A URL without its query: a presigned signature is a credential and stays out of messages."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def http_session(client: Any, verify: str | bool | None) -> URLLib3Session:
    """An HTTP session as botocore makes one for `client` (made with `verify`): from the client's public
    configuration, the environment's proxies and CA bundle as botocore reads them."""
    config = client.meta.config
    options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # botocore's, plus keepalive when asked for
    if config.tcp_keepalive:
        options.append((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1))
    # Typed loosely: botocore-stubs declares narrower types than botocore passes here itself.
    settings: dict[str, Any] = {
        "verify": verify if verify is not None else os.environ.get("REQUESTS_CA_BUNDLE", True),
        "proxies": config.proxies if config.proxies is not None else get_environ_proxies(client.meta.endpoint_url),
        "timeout": (config.connect_timeout, config.read_timeout),
        "max_pool_connections": config.max_pool_connections,
        "socket_options": options,
        "client_cert": config.client_cert,
        "proxies_config": config.proxies_config,
    }
    return URLLib3Session(**settings)


class DirectRequests:
    """GET and PUT of whole objects by presigned URL through an HTTP session like `client`'s, each retried
    through the failures `transient` names, `backoff.attempts` times in all."""

    def __init__(self, client: Any, verify: str | bool | None, transient: Callable[[BaseException], bool],
                 backoff: Backoff) -> None:
        self._session = http_session(client, verify)
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
        return retry(lambda: self._once(operation, request), self._backoff,
                     lambda e: isinstance(e, ClientError | BotoCoreError) and self._transient(e))

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
