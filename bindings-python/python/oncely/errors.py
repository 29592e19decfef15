"""The exceptions oncely raises: one root, :class:`OncelyError`, with the gRPC code.

The native module maps every error of the Rust core to one of these classes (the
mapping is in ``bindings-python/src/errors.rs``). Exceptions raised by *your* code pass
through oncely unchanged; they are never wrapped.
"""

from __future__ import annotations

from typing import ClassVar, Optional

from ._codes import Code


class OncelyError(Exception):
    """Root of every exception oncely itself raises. ``code`` is its gRPC code,
    ``kind`` the stable snake_case name of the error (the same in Rust and Node) and
    ``http_status`` the status a server answers with it."""

    default_code: ClassVar[Code] = Code.UNKNOWN
    code: Code
    #: Stable name of the error, e.g. ``"in_progress"`` (Rust ``Error::kind``).
    kind: str = "other"
    #: The HTTP status a server answers with this error (Rust ``Error::http_status``).
    http_status: int = 500

    def __init__(self, message: str, *, code: Optional[int] = None) -> None:
        super().__init__(message)
        self.code = Code(code) if code is not None else self.default_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(OncelyError, ValueError):
    """A setting or argument is out of range (INVALID_ARGUMENT). ``field`` names it."""

    kind = "invalid_argument"
    http_status = 400

    default_code = Code.INVALID_ARGUMENT

    def __init__(
        self, message: str, *, field: Optional[str] = None, code: Optional[int] = None
    ) -> None:
        super().__init__(message, code=code)
        self.field = field


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (INVALID_ARGUMENT): a ``TypeError`` as well as an
    :class:`InvalidArgumentError` (and so a ``ValueError``). ``field`` names it."""


class InvalidKeyError(InvalidArgumentError):
    """An idempotency key does not match ``[A-Za-z0-9_-]{8,64}`` (INVALID_ARGUMENT)."""


class MissingKeyError(InvalidKeyError):
    """A write arrived without an idempotency key (INVALID_ARGUMENT)."""

    kind = "missing_key"
    http_status = 400


class FingerprintMismatchError(OncelyError):
    """One key was reused with different request parameters (FAILED_PRECONDITION)."""

    kind = "fingerprint_mismatch"
    http_status = 422

    default_code = Code.FAILED_PRECONDITION


class InProgressError(OncelyError):
    """A call with this key is still running and the caller chose not to wait (ABORTED).
    ``retry_after`` is the suggested wait in seconds (HTTP 409 + ``Retry-After``)."""

    kind = "in_progress"
    http_status = 409

    default_code = Code.ABORTED

    def __init__(
        self, message: str, *, retry_after: float = 1.0, code: Optional[int] = None
    ) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class LeaseLostError(OncelyError):
    """The leader's claim on a key was taken over; its result was not stored (ABORTED)."""

    kind = "lease_lost"
    http_status = 409

    default_code = Code.ABORTED


class CapacityError(OncelyError):
    """The store is full of running operations (RESOURCE_EXHAUSTED)."""

    kind = "capacity"
    http_status = 503

    default_code = Code.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, max_entries: int = 0, code: Optional[int] = None) -> None:
        super().__init__(message, code=code)
        self.max_entries = max_entries


class StoreUnavailableError(OncelyError):
    """The store could not be reached; nothing was executed (UNAVAILABLE)."""

    kind = "unavailable"
    http_status = 503

    default_code = Code.UNAVAILABLE


class LeaderPanickedError(OncelyError):
    """The call this one waited for failed without an exception to share (INTERNAL)."""

    kind = "leader_panicked"
    http_status = 500

    default_code = Code.INTERNAL


class ReentrantCallError(OncelyError):
    """An action called ``execute`` with the key it is leading; it would wait for
    itself forever (FAILED_PRECONDITION). ``key`` is the scoped key."""

    kind = "reentrant"
    http_status = 500

    default_code = Code.FAILED_PRECONDITION
    key: str

    def __init__(self, message: str, *, key: str = "", code: Optional[int] = None) -> None:
        super().__init__(message, code=code)
        self.key = key


class ResultNotStoredError(OncelyError):
    """The operation ran once, but its result could not be encoded by the store, so it
    cannot be replayed; it is not run again (DATA_LOSS). ``type_name`` names the type."""

    kind = "result_not_stored"
    http_status = 500

    default_code = Code.DATA_LOSS
    key: str
    type_name: str

    def __init__(
        self, message: str, *, key: str = "", type_name: str = "", code: Optional[int] = None
    ) -> None:
        super().__init__(message, code=code)
        self.key = key
        self.type_name = type_name


def http_status_of(error: BaseException) -> Optional[int]:
    """The HTTP status a server answers with an error of oncely (its ``http_status``:
    400 invalid or missing key, 422 fingerprint mismatch, 409 in progress or lease lost,
    503 store unavailable or full, 500 otherwise), or None for any other exception."""
    if isinstance(error, OncelyError):
        return error.http_status
    return None


__all__ = [
    "http_status_of",
    "OncelyError",
    "InvalidArgumentError",
    "ArgumentTypeError",
    "InvalidKeyError",
    "MissingKeyError",
    "FingerprintMismatchError",
    "InProgressError",
    "LeaseLostError",
    "CapacityError",
    "StoreUnavailableError",
    "LeaderPanickedError",
    "ReentrantCallError",
    "ResultNotStoredError",
]
