"""oncely: remote calls that happen effectively once.

Retry with capped, jittered backoff (:func:`retry`, :func:`retry_sync`,
:func:`retrying`), decide which failures may be retried (:func:`classify`, :class:`Code`),
make idempotency keys (:func:`new_key`, :func:`derive_key`, :func:`scope`,
:func:`fingerprint`) and deduplicate by them on the server
(:class:`IdempotencyStore`, or :class:`RedisStore` shared by many processes),
with the server contract in :mod:`oncely.http`, the server adapters :mod:`oncely.asgi`,
:mod:`oncely.wsgi`, :mod:`oncely.grpc` and :mod:`oncely.grpc.aio`, and the client
adapters :mod:`oncely.httpx` and :mod:`oncely.requests` (optional frameworks are never
imported by ``import oncely``). All the logic is in the Rust core; this package is a thin
layer over its native module ``oncely._oncely``. Durations are seconds (``float``;
``datetime.timedelta`` is accepted too).
"""

from __future__ import annotations

from . import headers, http
from ._adapter import Store
from ._codes import Code
from ._oncely import (
    DEFAULT_TTL,
    KEY_MAX_LEN,
    KEY_MIN_LEN,
    BudgetSnapshot,
    Classification,
    Counters,
    Deadline,
    Executed,
    Failure,
    ManualClock,
    ReasonCodes,
    RetryBudget,
    RetryPolicy,
    ScopedKey,
    canonical_json,
    classify,
    derive_key,
    fingerprint,
    fingerprint_bytes,
    new_key,
    parse_pushback_ms,
    parse_retry_after,
    scope,
    validate_key,
)
from .errors import (
    ArgumentTypeError,
    CapacityError,
    FingerprintMismatchError,
    InProgressError,
    InvalidArgumentError,
    InvalidKeyError,
    LeaderPanickedError,
    LeaseLostError,
    MissingKeyError,
    OncelyError,
    ReentrantCallError,
    ResultNotStoredError,
    StoreUnavailableError,
    http_status_of,
)
from .extract import code_of, failure_of
from .redis_store import RedisRecord, RedisStore
from .retry import Attempt, RetryEvent, Seconds, retry, retry_sync, retrying
from .store import IdempotencyStore

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "Attempt",
    "BudgetSnapshot",
    "CapacityError",
    "Classification",
    "Code",
    "Counters",
    "DEFAULT_TTL",
    "Deadline",
    "Executed",
    "Failure",
    "FingerprintMismatchError",
    "IdempotencyStore",
    "InProgressError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "KEY_MAX_LEN",
    "KEY_MIN_LEN",
    "LeaderPanickedError",
    "ReentrantCallError",
    "ResultNotStoredError",
    "LeaseLostError",
    "ManualClock",
    "ReasonCodes",
    "MissingKeyError",
    "OncelyError",
    "RetryBudget",
    "RetryEvent",
    "RedisRecord",
    "RedisStore",
    "RetryPolicy",
    "ScopedKey",
    "Seconds",
    "Store",
    "StoreUnavailableError",
    "canonical_json",
    "classify",
    "code_of",
    "derive_key",
    "failure_of",
    "fingerprint",
    "fingerprint_bytes",
    "headers",
    "http",
    "http_status_of",
    "new_key",
    "parse_pushback_ms",
    "parse_retry_after",
    "retry",
    "retry_sync",
    "retrying",
    "scope",
    "validate_key",
]
