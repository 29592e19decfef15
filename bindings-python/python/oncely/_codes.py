"""gRPC status codes (the 17 canonical ones) as an ``IntEnum``."""

from __future__ import annotations

from enum import IntEnum

from . import _oncely


class Code(IntEnum):
    """A gRPC status code. ``int(code)`` is its canonical number."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def from_http(cls, status: int) -> Code:
        """The code an HTTP status maps to (the core's table: 429 → RESOURCE_EXHAUSTED,
        503 → UNAVAILABLE, other 4xx → FAILED_PRECONDITION, ...)."""
        return cls(_oncely.code_from_http(status))

    @classmethod
    def parse(cls, name: str) -> Code:
        """The code named ``name`` (``"UNAVAILABLE"``, case-insensitive) or a number as text."""
        return cls(_oncely.code_from_name(name))


# The names and numbers are the core's: a mismatch is a build error, not a silent drift.
if [c.name for c in Code] != _oncely.code_names():  # pragma: no cover
    raise ImportError("oncely.Code is out of step with the native module")
