"""httpx transports that retry with :func:`oncely.retry` semantics (SPEC §4) and give
every logical call of a covered method (POST and PATCH by default) one
``Idempotency-Key``, kept across its retries, so a server that deduplicates (an oncely
adapter, Stripe, ...) applies it once::

    client = httpx.AsyncClient(transport=oncely.httpx.AsyncRetryTransport())

A key the caller set is kept. A response of 400 or more is classified by its status and
``Retry-After`` by the core (SPEC §3: 408, 429, 502, 503 and 504 are retried; 409,
422, other 4xx and 500 are final), except that a keyed request answered 409 with a
``Retry-After`` (in progress: an earlier attempt whose answer was lost still runs) is
retried after that delay;
network errors by their type. When the retries stop on a response, that response is
returned (its body read); when they stop on an error, it is raised (with
``.attempts`` and ``.stop_reason``). Requests of methods that are neither covered nor
idempotent by HTTP (RFC 9110: GET, HEAD, OPTIONS, TRACE, PUT, DELETE) are resent only
when the failure says the request was not processed. Needs ``httpx``.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import httpx

from ._client import ResponseFailure, _Options, failure
from ._oncely import Deadline, RetryBudget, RetryPolicy
from .retry import OnRetry, Seconds, retry, retry_sync

__all__ = ["AsyncRetryTransport", "RetryTransport", "ResponseFailure"]


class AsyncRetryTransport(httpx.AsyncBaseTransport):
    """Wraps an async transport (default ``httpx.AsyncHTTPTransport()``): one key per
    logical call of ``methods``, retried by ``policy`` within ``deadline`` and ``budget``."""

    def __init__(
        self,
        transport: Optional[httpx.AsyncBaseTransport] = None,
        *,
        methods: Sequence[str] = ("POST", "PATCH"),
        policy: Optional[RetryPolicy] = None,
        deadline: Union[Deadline, Seconds, None] = None,
        budget: Optional[RetryBudget] = None,
        on_retry: Optional[OnRetry] = None,
    ) -> None:
        self._inner = transport if transport is not None else httpx.AsyncHTTPTransport()
        self._o = _Options(methods, policy, deadline, budget, on_retry)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        safe = self._o.prepare(request.headers, request.method)
        await request.aread()  # the body is sent again on every attempt

        async def attempt() -> httpx.Response:
            response = await self._inner.handle_async_request(request)
            if response.status_code < 400:
                return response
            raw = b"".join([chunk async for chunk in response.aiter_raw()])
            await response.aclose()
            read = httpx.Response(
                response.status_code,
                headers=response.headers,
                stream=httpx.ByteStream(raw),
                extensions=response.extensions,
            )
            raise failure(read)

        try:
            return await retry(attempt, safe=safe, **self._o.kw)
        except ResponseFailure as f:
            return f.response  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self._inner.aclose()


class RetryTransport(httpx.BaseTransport):
    """The blocking variant of :class:`AsyncRetryTransport` (``httpx.Client``)."""

    def __init__(
        self,
        transport: Optional[httpx.BaseTransport] = None,
        *,
        methods: Sequence[str] = ("POST", "PATCH"),
        policy: Optional[RetryPolicy] = None,
        deadline: Union[Deadline, Seconds, None] = None,
        budget: Optional[RetryBudget] = None,
        on_retry: Optional[OnRetry] = None,
    ) -> None:
        self._inner = transport if transport is not None else httpx.HTTPTransport()
        self._o = _Options(methods, policy, deadline, budget, on_retry)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        safe = self._o.prepare(request.headers, request.method)
        request.read()

        def attempt() -> httpx.Response:
            response = self._inner.handle_request(request)
            if response.status_code < 400:
                return response
            raw = b"".join(response.iter_raw())
            response.close()
            read = httpx.Response(
                response.status_code,
                headers=response.headers,
                stream=httpx.ByteStream(raw),
                extensions=response.extensions,
            )
            raise failure(read)

        try:
            return retry_sync(attempt, safe=safe, **self._o.kw)
        except ResponseFailure as f:
            return f.response  # type: ignore[no-any-return]

    def close(self) -> None:
        self._inner.close()
