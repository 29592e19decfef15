"""What the sync and asyncio gRPC interceptors share: settings, the stored record of a
gRPC answer (the record format of every oncely adapter: status 200, the message as one
uncompressed gRPC frame, ``grpc-status`` and ``grpc-message`` as trailers) and the
reading of a key from the call's metadata. Every decision is the core's."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union
from urllib.parse import unquote

from .. import http
from .._adapter import AppFailed, CounterSet, Unstored, check_options, log
from .._oncely import ScopedKey
from ..errors import ArgumentTypeError, OncelyError, StoreUnavailableError

grpc: Any = importlib.import_module("grpc")

STATUS = {s.value[0]: s for s in grpc.StatusCode}
_OK = grpc.StatusCode.OK
_CONTENT_TYPE = [("content-type", b"application/grpc")]
_REPLAYED = ((http.REPLAYED_HEADER, http.REPLAYED_VALUE),)


def frame(message: bytes) -> bytes:
    """One uncompressed gRPC message frame."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


Pairs = list[tuple[str, bytes]]
# Trailers the record writes itself, or that a replay adds.
_OWN = frozenset({"grpc-status", "grpc-message", http.REPLAYED_HEADER})


def trailers_of(context: Any) -> Pairs:
    """The trailing metadata the handler set (``set_trailing_metadata``, or
    ``abort_with_status``'s ``grpc-status-details-bin``): kept with the answer."""
    out: Pairs = []
    getter = getattr(context, "trailing_metadata", None)
    for item in (getter() if getter is not None else None) or ():
        name, value = str(item[0]).lower(), item[1]
        if name not in _OWN:
            out.append((name, value.encode() if isinstance(value, str) else bytes(value)))
    return out


def record_ok(message: bytes, trailers: Sequence[tuple[str, bytes]] = ()) -> bytes:
    return http.encode_response(
        200, _CONTENT_TYPE, frame(message), [("grpc-status", b"0"), *trailers]
    )


def record_status(
    code: int, details: Union[str, bytes, None], trailers: Sequence[tuple[str, bytes]] = ()
) -> bytes:
    own = [("grpc-status", str(code).encode())]
    if isinstance(details, bytes):  # the sync server keeps them encoded
        details = details.decode("utf-8", "replace")
    if details:
        own.append(("grpc-message", _percent_encode(details)))
    return http.encode_response(200, _CONTENT_TYPE, b"", [*own, *trailers])


def _percent_encode(text: str) -> bytes:
    """gRPC's ``grpc-message`` encoding (as sent on the wire)."""
    return b"".join(
        bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in text.encode()
    )


def read_record(record: Any) -> tuple[int, str, bytes, tuple[tuple[str, Any], ...]]:
    """``(code, details, message, metadata)`` of a stored gRPC answer (from any oncely
    adapter); ``metadata`` is the trailing metadata to send, marker included."""
    status, headers, body, trailers = http.decode_response(record)
    meta_out = (
        tuple(
            (n, v if n.endswith("-bin") else v.decode("utf-8", "replace"))
            for n, v in trailers
            if n not in _OWN
        )
        + _REPLAYED
    )
    meta = dict(headers)
    meta.update(trailers)
    raw = meta.get("grpc-status")
    if status != 200 or raw is None or not raw.isdigit():
        raise StoreUnavailableError("the stored response is not a gRPC answer")
    code = int(raw)
    if code not in STATUS:
        raise StoreUnavailableError(f"the stored gRPC answer has an unknown status {code}")
    if code != 0:
        return code, unquote(meta.get("grpc-message", b"").decode("latin-1")), b"", meta_out
    if len(body) < 5 or body[0] != 0 or int.from_bytes(body[1:5], "big") != len(body) - 5:
        raise StoreUnavailableError("the stored gRPC message is not one uncompressed frame")
    return 0, "", body[5:], meta_out


def code_of(context: Any) -> int:
    """The code the handler set on ``context`` (OK when none)."""
    code = context.code()
    if code is None:
        return 0
    value = code.value[0] if isinstance(code, grpc.StatusCode) else int(code)
    return int(value)


class GrpcSettings:
    def __init__(
        self,
        *,
        store: object,
        store_method: str,
        tenant: Union[str, Callable[[Any], str], None],
        methods: Optional[Sequence[str]],
        required: bool,
        wait: bool,
        body_cap: int,
        on_replay: Optional[Callable[[Any, ScopedKey], None]],
        counters: Optional[CounterSet],
    ) -> None:
        check_options(
            store=store,
            store_method=store_method,
            tenant=tenant,
            callbacks={"on_replay": on_replay},
            counters=counters,
        )
        if methods is not None and (
            isinstance(methods, (str, bytes))
            or not isinstance(methods, Sequence)
            or not all(isinstance(m, str) for m in methods)
        ):
            raise ArgumentTypeError(
                f"methods must be a sequence of str (full method names), not {type(methods).__name__}",
                field="methods",
            )
        self.contract = http.ServerConfig(
            required=required,
            wait=wait,
            body_cap=body_cap,
            grpc_methods=methods,
        )
        self.tenant = tenant
        self.on_replay = on_replay
        self.counters = counters if counters is not None else CounterSet()

    def tenant_of(self, context: Any) -> str:
        t = self.tenant
        if t is None:
            return http.DEFAULT_TENANT
        return t if isinstance(t, str) else t(context)

    def scoped(self, context: Any, method: str, key: str) -> Union[ScopedKey, http.Problem]:
        """The scoped key of a call (``POST`` and its full method name), or the problem
        to answer with (a tenant no key can be scoped by: INTERNAL ``tenant-unusable``)."""
        try:
            return http.scope(self.tenant_of(context), "POST", method, key)
        except OncelyError as e:
            if getattr(e, "field", None) == "tenant":
                return http.Problem.tenant_unusable(str(e))
            return http.Problem.from_error(e)

    def admit(self, context: Any, method: str) -> Union[ScopedKey, http.Problem, None]:
        """The scoped key of a call, the problem to refuse it with, or ``None`` for a
        call without a key that is passed through (counted here)."""
        decision = self.contract.read_grpc_key(method, self.key_values(context))
        if decision is None:
            self.counters.bump("passed_through")
            return None
        if isinstance(decision, http.Problem):
            return decision
        return self.scoped(context, method, decision)

    def replaying(
        self, context: Any, scoped: ScopedKey, metadata: tuple[tuple[str, Any], ...]
    ) -> None:
        """Counts a replay, tells ``on_replay`` and sets the stored trailing metadata."""
        self.counters.bump("replayed")
        if self.on_replay is not None:
            try:
                self.on_replay(context, scoped)
            except Exception:
                # As the HTTP adapters: a failing hook never changes the replay.
                log.exception("oncely: the on_replay hook raised")
        context.set_trailing_metadata(metadata)

    def key_values(self, context: Any) -> list[bytes]:
        out: list[bytes] = []
        for item in context.invocation_metadata() or ():
            key, value = item[0], item[1]
            if key == http.GRPC_KEY_METADATA:
                out.append(value.encode("latin-1") if isinstance(value, str) else bytes(value))
        return out


def pushback(problem: http.Problem) -> list[tuple[str, str]]:
    """The trailing metadata of a refusal: the retry pushback, when there is a delay."""
    return [(n, v) for n, v in problem.grpc_metadata() if n == "grpc-retry-pushback-ms"]


def unwrap(
    handler: Any,
) -> Optional[tuple[Callable[..., Any], Callable[[bytes], Any], Callable[[Any], bytes]]]:
    """The behavior and (de)serializers of a unary-unary handler, else ``None``."""
    if handler is None or handler.request_streaming or handler.response_streaming:
        return None
    if handler.unary_unary is None:
        return None
    deser = handler.request_deserializer or (lambda b: b)
    ser = handler.response_serializer or (lambda m: m)
    return handler.unary_unary, deser, ser


def settle(run: Any, counters: CounterSet, code: int) -> bytes:
    """The record of a finished call: stored when its status is final."""
    trailers = trailers_of(run.context)
    if code == 0:
        record = record_ok(run.body, trailers)
        if not run.s.contract.body_fits(len(run.body) + 5):
            # SPEC §8: never a body over the cap; the key is released, the duplicates
            # waiting now get this answer.
            counters.bump("not_stored")
            raise Unstored(run, record)
        counters.bump("stored")
        return record
    record = record_status(code, run.context.details(), trailers)
    if http.storable_grpc_status(str(code).encode()):
        counters.bump("stored")
        return record
    counters.bump("not_stored")
    raise Unstored(run, record)


class Lead:
    """One call's run of the handler under its key; its answer is kept for the leader
    (every detail the handler set) and recorded for the store. The sync and asyncio
    interceptors each drive the handler between :meth:`start` and :meth:`finish`."""

    def __init__(
        self,
        s: GrpcSettings,
        behavior: Callable[[Any, Any], Any],
        deser: Callable[[bytes], Any],
        ser: Callable[[Any], bytes],
        raw: bytes,
        context: Any,
        mark: tuple[object, ScopedKey],
    ) -> None:
        self.s, self.behavior, self.deser, self.ser = s, behavior, deser, ser
        self.raw, self.context = raw, context
        self.led = False
        self.body = b""
        self.error: Optional[BaseException] = None
        self.answered = False  # the handler has given its answer (stored or not)
        # (store, scoped key): the call's mark while the handler runs (see
        # ``leading_call``).
        self.mark = mark

    def start(self) -> None:
        self.led = True
        self.s.counters.bump("led")

    def respond(self, message: Any) -> None:
        """The handler returned ``message``: serialized when the status is OK (grpc
        sends no message with another status, and a handler that set one may return
        ``None``)."""
        self.body = self.ser(message) if code_of(self.context) == 0 else b""

    def failed(self, e: Exception) -> None:
        """The handler raised: kept when it set a status (an abort), else not stored."""
        if code_of(self.context) == 0:  # a plain exception, not an abort: UNKNOWN, never stored
            self.s.counters.bump("not_stored")
            raise AppFailed(self, e) from None
        self.error = e

    def finish(self) -> bytes:
        self.answered = True
        return settle(self, self.s.counters, code_of(self.context))

    def answer(self) -> bytes:
        """The leader's own answer: its message, or the abort it raised."""
        if self.error is not None:
            raise self.error
        return self.body
