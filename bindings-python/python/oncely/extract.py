"""Which gRPC code a Python exception means, and the delay its server asked for.

This module only *reads* an exception: it walks the object (attributes, the response
it carries, a gRPC error's ``code()`` and trailing metadata, the ``__cause__`` chain)
and hands the raw facts to the Rust core, whose rules (SPEC §3, "Extraction") decide
the code and the delay, the same rules Rust and Node apply. Clients are detected by
duck typing (no import of grpc, httpx, aiohttp or requests). Facts read per exception:

=====================  ==============================================================
fact                   read from
=====================  ==============================================================
code                   ``exc.code`` (a value, or ``exc.code()`` for gRPC errors); an
                       enum member gives its number (gRPC ``StatusCode``) or its name
status                 ``exc.status``, else ``exc.response.status_code`` / ``.status``
status_code            ``exc.status_code``
errno                  ``exc.errno`` of an ``OSError``, as its name (``ECONNRESET``)
type names             the classes along the MRO: built-ins by name
                       (``ConnectionResetError``), others as ``module.Class``
                       (``httpx.TimeoutException``)
headers                ``Retry-After`` and gRPC metadata (``exc.headers``,
                       ``exc.response.headers``, ``exc.trailing_metadata()``)
own delay              ``InProgressError.retry_after``
=====================  ==============================================================
"""

from __future__ import annotations

import base64
import errno as _errno
from typing import Any, Callable, Optional, Union

from . import _oncely
from ._codes import Code
from ._oncely import Failure, ReasonCodes
from .errors import InProgressError

__all__ = ["failure_of", "code_of", "Failure", "Classifier", "ReasonCodes"]

#: A user classifier: returns a ``Code`` (or int), a ``Failure``, or None to fall back
#: to :func:`failure_of`.
Classifier = Callable[[BaseException], Union[Code, int, Failure, None]]

_UNKNOWN = int(Code.UNKNOWN)
_HEADERS: tuple[str, ...] = tuple(_oncely.extract_headers())
# The core reads the error and at most four causes.
_MAX_CHAIN = 5

Level = tuple[Any, Any, Any, Optional[str], list[str], list[tuple[str, str]], Optional[float]]


def failure_of(exc: BaseException, reasons: Optional[ReasonCodes] = None) -> Union[int, Failure]:
    """The failure ``exc`` stands for: a code (int) or a :class:`Failure` with the
    server's delay. ``reasons``: the domain reason codes to understand (default: the
    built-in ones). Never raises: an exception whose attributes cannot be read (a
    property or ``__getattr__`` that raises) is UNKNOWN, so that a failure path that
    classifies it still settles."""
    try:
        levels: list[Level] = []
        seen: BaseException | None = exc
        while seen is not None and len(levels) < _MAX_CHAIN:
            levels.append(_level(seen))
            seen = seen.__cause__
        f = _oncely.extract(levels, reasons)
    except Exception:
        return _UNKNOWN
    if f.delay is None and not f.do_not_retry:
        return f.code
    return f


def _level(exc: BaseException) -> Level:
    code: Any = None
    headers: list[tuple[str, str]] = []
    code_attr = getattr(exc, "code", None)
    if callable(code_attr):
        code = _safe(code_attr)
        if hasattr(exc, "trailing_metadata"):  # grpc.RpcError / grpc.aio.AioRpcError
            _metadata(_safe(exc.trailing_metadata), headers)
    else:
        code = code_attr
    code = _plain(code)
    status = _plain(getattr(exc, "status", None))
    _headers(getattr(exc, "headers", None), headers)
    response = getattr(exc, "response", None)
    if response is not None:
        if status is None:
            status = _plain(getattr(response, "status_code", None))
        if status is None:
            status = _plain(getattr(response, "status", None))
        _headers(getattr(response, "headers", None), headers)
    status_code = _plain(getattr(exc, "status_code", None))
    errno_name = None
    if isinstance(exc, OSError) and isinstance(exc.errno, int):
        errno_name = _errno.errorcode.get(exc.errno)
    names = []
    for cls in type(exc).__mro__:
        module = cls.__module__.partition(".")[0]
        names.append(cls.__name__ if module == "builtins" else f"{module}.{cls.__name__}")
    delay = exc.retry_after if isinstance(exc, InProgressError) else None
    return (code, status, status_code, errno_name, names, headers, delay)


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _plain(value: Any) -> Any:
    """An int or a str the core can read; a foreign enum gives its number or name."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, str)):
        return int(value) if isinstance(value, int) else str.__str__(value)
    inner = getattr(value, "value", None)  # grpc.StatusCode.X.value == (14, "unavailable")
    if isinstance(inner, tuple) and inner:
        inner = inner[0]
    if isinstance(inner, int) and not isinstance(inner, bool):
        return int(inner)
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else None


def _text(name: str, value: Any) -> Optional[str]:
    """A header or metadata value as text; binary (``-bin``) values in base64."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        if name.lower().endswith("-bin"):
            return base64.b64encode(bytes(value)).decode("ascii")
        return bytes(value).decode("latin-1")
    return None


def _headers(headers: Any, out: list[tuple[str, str]]) -> None:
    """The pairs the core reads, from a mapping with a (case-insensitive) ``get``."""
    if headers is None:
        return
    getter = getattr(headers, "get", None)
    if not callable(getter):
        return
    for name in _HEADERS:
        try:
            value = getter(name)
            if value is None:
                value = getter(name.title())
        except Exception:
            continue
        text = _text(name, value)
        if text is not None:
            out.append((name, text))


def _metadata(metadata: Any, out: list[tuple[str, str]]) -> None:
    """gRPC metadata: a sequence of ``(key, value)`` pairs; binary values as base64."""
    if not metadata:
        return
    try:
        for key, value in metadata:
            text = _text(str(key), value)
            if isinstance(key, str) and key.lower() in _HEADERS and text is not None:
                out.append((key, text))
    except Exception:
        return


def code_of(exc: BaseException, reasons: Optional[ReasonCodes] = None) -> Code:
    """The gRPC code ``exc`` stands for (see :func:`failure_of`)."""
    f = failure_of(exc, reasons)
    return Code(f if isinstance(f, int) else f.code)


def classify_exception(
    exc: BaseException, classifier: Optional[Classifier], reasons: Optional[ReasonCodes] = None
) -> Union[int, Failure]:
    """``classifier(exc)`` if it gives an answer, else :func:`failure_of`."""
    if classifier is not None:
        answer = classifier(exc)
        if answer is not None:
            return answer
    return failure_of(exc, reasons)
