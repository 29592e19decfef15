"""``IdempotencyInterceptor`` for a grpcio (thread pool) server: the server contract
(SPEC §8) for unary-unary methods, on an :class:`~oncely.IdempotencyStore` or a
:class:`~oncely.RedisStore` through ``execute_sync``::

    server = grpc.server(pool, interceptors=[IdempotencyInterceptor(store=store)])

The key is the ``x-idempotency-key`` metadata; the scope is the tenant, ``POST`` and the
full method name; the fingerprint is that of the serialized request. The stored answer
is the serialized response message (or a final status: OK, INVALID_ARGUMENT,
NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED, FAILED_PRECONDITION, OUT_OF_RANGE,
UNAUTHENTICATED), with the trailing metadata the handler set (e.g. the
``grpc-status-details-bin`` of ``abort_with_status``); a replay sends it all again,
with ``idempotent-replayed: true`` added to the trailing metadata. Other statuses and exceptions are not stored (a retry runs
again). A missing or invalid key is INVALID_ARGUMENT, a reused key with another request
FAILED_PRECONDITION, a running duplicate with ``wait=False`` ABORTED with
``grpc-retry-pushback-ms``. Streaming methods pass through. :mod:`oncely.grpc.aio` is
the ``grpc.aio`` variant. Needs ``grpcio``.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Optional, Sequence, Union

from .. import http
from .._adapter import (
    AppFailed,
    Counters,
    CounterSet,
    SyncStore,
    Unstored,
    call_led_already,
    leading_call,
    problem_of,
)
from .._oncely import ScopedKey
from ..errors import OncelyError
from ._common import (
    STATUS,
    GrpcSettings,
    Lead,
    code_of,
    frame,
    grpc,
    pushback,
    read_record,
    unwrap,
)

__all__ = ["IdempotencyInterceptor", "Counters", "CounterSet"]


class IdempotencyInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Makes the covered unary-unary methods of a grpcio server idempotent.

    - ``store``: an :class:`~oncely.IdempotencyStore` or a :class:`~oncely.RedisStore`.
    - ``tenant``: a string, or a function of the ``ServicerContext`` (e.g. from its
      ``auth_context()`` or metadata); default one tenant for every caller.
    - ``methods``: the covered full method names (``"/shop.Orders/Create"``); default
      every unary-unary method.
    - ``required`` (a call without a key is INVALID_ARGUMENT; ``False``: passed through),
      ``wait`` (``False``: a running duplicate gets ABORTED + pushback), ``body_cap``
      (the largest answer stored, its framed message; default 1 MiB), ``on_replay``
      (called with the context and the scoped key), ``counters``.
    """

    def __init__(
        self,
        *,
        store: SyncStore,
        tenant: Union[str, Callable[[Any], str], None] = None,
        methods: Optional[Sequence[str]] = None,
        required: bool = True,
        wait: bool = True,
        body_cap: int = http.DEFAULT_BODY_CAP,
        on_replay: Optional[Callable[[Any, ScopedKey], None]] = None,
        counters: Optional[CounterSet] = None,
    ) -> None:
        self.store = store
        self._s = GrpcSettings(
            store=store,
            store_method="execute_sync",
            tenant=tenant,
            methods=methods,
            required=required,
            wait=wait,
            body_cap=body_cap,
            on_replay=on_replay,
            counters=counters,
        )

    def counters(self) -> Counters:
        """What this interceptor has done so far."""
        return self._s.counters.snapshot()

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        parts = unwrap(handler)
        method: str = handler_call_details.method
        if parts is None or not self._s.contract.covers_grpc(method):
            return handler
        behavior, deser, ser = parts

        def guarded(raw: bytes, context: Any) -> bytes:
            return self._serve(method, behavior, deser, ser, raw, context)

        return grpc.unary_unary_rpc_method_handler(guarded)

    def _serve(
        self,
        method: str,
        behavior: Callable[[Any, Any], Any],
        deser: Callable[[bytes], Any],
        ser: Callable[[Any], bytes],
        raw: bytes,
        context: Any,
    ) -> bytes:
        s = self._s
        scoped = s.admit(context, method)
        if scoped is None:
            return ser(behavior(deser(raw), context))
        if isinstance(scoped, http.Problem):
            self._refuse(context, scoped)
        if call_led_already(context, self.store, scoped):
            # Installed twice with one store: the outer interceptor leads this call.
            s.counters.bump("passed_through")
            return ser(behavior(deser(raw), context))
        fp = http.request_fingerprint("POST", method, "application/grpc", frame(raw))
        run = _Lead(s, behavior, deser, ser, raw, context, (self.store, scoped))
        while True:
            try:
                done = self.store.execute_sync(scoped, fp, run.action, wait=s.contract.wait)
            except Unstored as u:
                if u.owner is run:
                    return run.answer()
                return self._replay(context, scoped, u.record)
            except AppFailed as af:
                if af.owner is run:
                    raise af.error from None
                self._refuse(context, problem_of(af))
            except OncelyError as e:
                if run.answered:
                    # The handler has run: its answer stands even when it could not be
                    # stored (store unreachable, lease lost); a refusal would invite a
                    # retry that runs it again.
                    return run.answer()
                self._refuse(context, http.Problem.from_error(e))
            if run.led:
                return run.answer()
            return self._replay(context, scoped, done.value)

    def _refuse(self, context: Any, problem: http.Problem) -> NoReturn:
        self._s.counters.bump("refused")
        context.set_trailing_metadata(pushback(problem))
        context.abort(STATUS[problem.grpc_code], problem.detail)
        raise AssertionError("context.abort returned")  # grpc's abort always raises

    def _replay(self, context: Any, scoped: ScopedKey, record: Any) -> bytes:
        try:
            code, details, message, metadata = read_record(record)
        except OncelyError as e:
            self._refuse(context, http.Problem.from_error(e))
        self._s.replaying(context, scoped, metadata)
        if code != 0:
            context.abort(STATUS[code], details)
        return message


class _Lead(Lead):
    def answer(self) -> bytes:
        if self.error is None and code_of(self.context) != 0:
            # The handler set a status without raising: sent as grpc sends it, with no
            # message (which its client would fail to read).
            self.context.abort(self.context.code(), self.context.details() or "")
        return super().answer()

    def action(self) -> bytes:
        self.start()
        try:
            with leading_call(self.context, *self.mark):
                answer = self.behavior(self.deser(self.raw), self.context)
            self.respond(answer)
        except Exception as e:
            self.failed(e)
        return self.finish()
