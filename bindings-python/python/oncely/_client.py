"""What the client adapters (:mod:`oncely.httpx`, :mod:`oncely.requests`) share: the
key added to covered requests and the failure an answer of 400 or more becomes."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from . import http
from ._oncely import Deadline, RetryBudget, RetryPolicy, new_key
from .retry import OnRetry, Seconds

_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class ResponseFailure(Exception):
    """An attempt answered with a status of 400 or more (read by oncely's extraction
    through ``.response``: its status and ``Retry-After``)."""

    def __init__(self, response: Any) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


def failure(response: Any) -> ResponseFailure:
    """The failure an answer of 400 or more stands for. A 409 with ``Retry-After`` to a
    keyed (safe) request is "in progress": the core resends it after the delay."""
    return ResponseFailure(response)


class _Options:
    def __init__(
        self,
        methods: Sequence[str],
        policy: Optional[RetryPolicy],
        deadline: Union[Deadline, Seconds, None],
        budget: Optional[RetryBudget],
        on_retry: Optional[OnRetry],
    ) -> None:
        self.methods = frozenset(methods)
        self.kw: dict[str, Any] = {
            "policy": policy,
            "deadline": deadline,
            "budget": budget,
            "on_retry": on_retry,
        }

    def prepare(self, headers: Any, method: str) -> bool:
        """Adds a key to a covered request without one; whether resending is safe (the
        method is idempotent or the request carries a key)."""
        if method in self.methods:
            if http.KEY_HEADER not in headers:
                headers[http.KEY_HEADER] = new_key()
            return True
        return method in _IDEMPOTENT or http.KEY_HEADER in headers
