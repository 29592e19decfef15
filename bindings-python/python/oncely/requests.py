"""A ``requests`` transport adapter that retries with :func:`oncely.retry_sync`
semantics (SPEC §4) and gives every logical call of a covered method (POST and PATCH
by default) one ``Idempotency-Key``, kept across its retries::

    session = requests.Session()
    session.mount("https://", oncely.requests.IdempotentAdapter())

The behaviour of :mod:`oncely.httpx`: a key the caller set is kept; a response of 400
or more is classified by its status and ``Retry-After`` (a keyed 409 with
``Retry-After`` is "in progress", retried after that delay) and returned when the
retries stop; a connection error is classified by its type and raised when they stop. A file
body is rewound for every attempt; a body that cannot be sent again (a generator) gets
one attempt. Needs
``requests``.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional, Sequence, Union

from ._client import ResponseFailure, _Options, failure
from ._oncely import Deadline, RetryBudget, RetryPolicy
from .retry import OnRetry, Seconds, retry_sync

__all__ = ["IdempotentAdapter", "ResponseFailure"]

_adapters: Any = importlib.import_module("requests.adapters")
_utils: Any = importlib.import_module("requests.utils")


class IdempotentAdapter(_adapters.HTTPAdapter):  # type: ignore[misc]
    """``requests.adapters.HTTPAdapter`` with oncely's keys and retries (its own
    ``max_retries`` stays 0: oncely decides)."""

    def __init__(
        self,
        *,
        methods: Sequence[str] = ("POST", "PATCH"),
        policy: Optional[RetryPolicy] = None,
        deadline: Union[Deadline, Seconds, None] = None,
        budget: Optional[RetryBudget] = None,
        on_retry: Optional[OnRetry] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._o = _Options(methods, policy, deadline, budget, on_retry)

    def send(self, request: Any, **kwargs: Any) -> Any:
        safe = self._o.prepare(request.headers, request.method)
        send = super().send
        body = request.body
        position = getattr(request, "_body_position", None)
        if not (body is None or isinstance(body, (bytes, str)) or isinstance(position, int)):
            # A body that cannot be sent again (a generator, a stream without tell()):
            # one attempt, never a retry whose body would differ under the same key.
            return send(request, **kwargs)
        sent = False

        def attempt() -> Any:
            nonlocal sent
            if sent and position is not None:
                _utils.rewind_body(request)  # a file body is sent again from its start
            sent = True
            response = send(request, **kwargs)
            if response.status_code < 400:
                return response
            _ = response.content  # read whole, so the connection is free for the retry
            raise failure(response)

        try:
            return retry_sync(attempt, safe=safe, **self._o.kw)
        except ResponseFailure as f:
            return f.response
