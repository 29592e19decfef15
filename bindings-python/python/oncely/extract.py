"""Which gRPC code a Python exception means, and the delay its server asked for.

This is the only judgement the Python layer makes about failures, and it is only
*extraction*: whether a code may be retried is the core's decision. Clients are detected
by duck typing (no import of grpc, httpx, aiohttp or requests):

========================================  =============================================
exception                                 code (server delay)
========================================  =============================================
``oncely.OncelyError``                    its ``code`` (``InProgressError.retry_after``)
``grpc.RpcError`` / ``grpc.aio.AioRpcError``  ``.code()`` (trailer ``grpc-retry-pushback-ms``)
``httpx.HTTPStatusError``                 ``Code.from_http(response.status_code)`` (``Retry-After``)
``requests.HTTPError``                    ``Code.from_http(response.status_code)`` (``Retry-After``)
``aiohttp.ClientResponseError``           ``Code.from_http(status)`` (``Retry-After``)
httpx/requests/aiohttp timeouts           DEADLINE_EXCEEDED
httpx/requests/aiohttp connection errors  UNAVAILABLE (the outcome is unknown)
builtin ``TimeoutError``                  DEADLINE_EXCEEDED
builtin ``ConnectionError``               UNAVAILABLE (the outcome is unknown)
an object with ``code`` / ``status_code`` a gRPC code (0-16, a name, an enum) or an HTTP status
anything else                             UNKNOWN (not retried)
========================================  =============================================
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

from . import _oncely
from ._codes import Code
from ._oncely import Failure
from .errors import InProgressError, OncelyError

__all__ = ["failure_of", "code_of", "Failure", "Classifier"]

#: A user classifier: returns a ``Code`` (or int), a ``Failure``, or None to fall back
#: to :func:`failure_of`.
Classifier = Callable[[BaseException], Union[Code, int, Failure, None]]

_UNKNOWN = int(Code.UNKNOWN)
_UNAVAILABLE = int(Code.UNAVAILABLE)
_DEADLINE = int(Code.DEADLINE_EXCEEDED)
_PUSHBACK = "grpc-retry-pushback-ms"

# Client libraries' transport errors, by (top-level module, class name) in the MRO.
# Timeouts first: in httpx and requests a timeout is also a transport error.
_TRANSPORT: tuple[tuple[str, str, int], ...] = (
    ("httpx", "TimeoutException", _DEADLINE),
    ("httpx", "TransportError", _UNAVAILABLE),
    ("requests", "Timeout", _DEADLINE),
    ("requests", "ConnectionError", _UNAVAILABLE),
    ("aiohttp", "ServerTimeoutError", _DEADLINE),
    ("aiohttp", "ConnectionTimeoutError", _DEADLINE),
    ("aiohttp", "ClientConnectionError", _UNAVAILABLE),
    ("urllib3", "TimeoutError", _DEADLINE),
    ("urllib3", "ProtocolError", _UNAVAILABLE),
    ("urllib3", "NewConnectionError", _UNAVAILABLE),
)


def failure_of(exc: BaseException) -> Union[int, Failure]:
    """The failure ``exc`` stands for: a code (int) or a :class:`Failure` with the
    server's delay. Never raises: an exception whose attributes cannot be read (a
    property or ``__getattr__`` that raises) is UNKNOWN, so that a failure path that
    classifies it still settles."""
    try:
        return _failure_of(exc)
    except Exception:
        return _UNKNOWN


def _failure_of(exc: BaseException) -> Union[int, Failure]:
    if isinstance(exc, OncelyError):
        if isinstance(exc, InProgressError):
            return Failure(exc.code, delay=exc.retry_after)
        return int(exc.code)

    # grpc.RpcError / grpc.aio.AioRpcError: code() is a grpc.StatusCode.
    code_attr = getattr(exc, "code", None)
    if callable(code_attr) and hasattr(exc, "trailing_metadata"):
        code = _grpc_code(code_attr)
        if code is not None:
            return _with_pushback(code, exc)

    # HTTP clients: a response with a status and headers.
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None) if response is not None else None
    if isinstance(status, int) and 100 <= status <= 599:
        return _with_retry_after(_oncely.code_from_http(status), getattr(response, "headers", None))
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError
    if isinstance(status, int) and 100 <= status <= 599 and hasattr(exc, "headers"):
        return _with_retry_after(_oncely.code_from_http(status), getattr(exc, "headers", None))

    kind = type(exc)
    code = _BY_TYPE.get(kind, -1)
    if code == -1:
        code = _BY_TYPE[kind] = _transport_code(kind)
    if code is not None:
        return code

    # Duck typing: `code` (a gRPC code, or an HTTP status), `status_code`.
    code = _code_value(code_attr() if callable(code_attr) else code_attr)
    if code is None:
        code = _http_value(getattr(exc, "status_code", None))
    return _UNKNOWN if code is None else code


# Exception type -> its transport code (or None); exception types are few.
_BY_TYPE: dict[type, Optional[int]] = {}


def _transport_code(kind: type) -> Optional[int]:
    for cls in kind.__mro__:
        module = cls.__module__.partition(".")[0]
        for mod, name, code in _TRANSPORT:
            if module == mod and cls.__name__ == name:
                return code
    if issubclass(kind, TimeoutError):
        return _DEADLINE
    if issubclass(kind, ConnectionError):
        return _UNAVAILABLE
    return None


def code_of(exc: BaseException) -> Code:
    """The gRPC code ``exc`` stands for (see :func:`failure_of`)."""
    f = failure_of(exc)
    return Code(f if isinstance(f, int) else f.code)


def classify_exception(exc: BaseException, classifier: Optional[Classifier]) -> Union[int, Failure]:
    """``classifier(exc)`` if it gives an answer, else :func:`failure_of`."""
    if classifier is not None:
        answer = classifier(exc)
        if answer is not None:
            return answer
    return failure_of(exc)


def _grpc_code(code_fn: Callable[[], Any]) -> Optional[int]:
    try:
        status = code_fn()
    except Exception:
        return None
    value = getattr(status, "value", status)  # grpc.StatusCode.X.value == (14, "unavailable")
    if isinstance(value, tuple) and value:
        value = value[0]
    return _code_value(value)


def _code_value(value: Any) -> Optional[int]:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if 0 <= value <= 16:
            return int(value)
        return _http_value(value)
    if isinstance(value, str):
        try:
            return int(Code.parse(value))
        except ValueError:
            return None
    name = getattr(value, "name", None)  # a foreign enum of gRPC codes
    if isinstance(name, str) and name in Code.__members__:
        return int(Code[name])
    return None


def _http_value(value: Any) -> Optional[int]:
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
        return _oncely.code_from_http(value)
    return None


def _header(headers: Any, name: str) -> Optional[str]:
    if headers is None:
        return None
    try:
        value = headers.get(name)
        if value is None:
            value = headers.get(name.lower())
    except Exception:
        return None
    return value if isinstance(value, str) else None


def _with_retry_after(code: int, headers: Any) -> Union[int, Failure]:
    value = _header(headers, "Retry-After")
    if value is None:
        return code
    return Failure.from_headers(code, retry_after=value)


def _with_pushback(code: int, exc: Any) -> Union[int, Failure]:
    try:
        metadata = exc.trailing_metadata()
    except Exception:
        return code
    if not metadata:
        return code
    try:
        for key, value in metadata:
            if key == _PUSHBACK:
                if isinstance(value, bytes):
                    value = value.decode("ascii", "replace")
                return Failure.from_headers(code, pushback_ms=str(value))
    except Exception:
        return code
    return code
