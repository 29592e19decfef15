"""``IdempotencyInterceptor`` for a ``grpc.aio`` server: the behaviour of
:class:`oncely.grpc.IdempotencyInterceptor`, with the store's ``execute``::

    server = grpc.aio.server(interceptors=[IdempotencyInterceptor(store=store)])

The handler runs in a task of its own: a client that cancels its call stops waiting,
while the handler runs on and its answer is stored for the retry.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import inspect
from typing import Any, Callable, NoReturn, Optional, Sequence, Union

from .. import http
from .._adapter import (
    AppFailed,
    AsyncStore,
    Counters,
    CounterSet,
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
    frame,
    grpc,
    pushback,
    read_record,
    unwrap,
)

__all__ = ["IdempotencyInterceptor", "Counters", "CounterSet"]

_aio: Any = importlib.import_module("grpc.aio")
# grpc.aio runs a plain `def` handler in a thread pool with this sync context (its
# `abort` raises); the interceptor's wrapper is async, so it does the same (see `_call`).
_SyncContext: Any = getattr(
    importlib.import_module("grpc._cython.cygrpc"), "_SyncServicerContext", None
)


class IdempotencyInterceptor(_aio.ServerInterceptor):  # type: ignore[misc]
    """Makes the covered unary-unary methods of a ``grpc.aio`` server idempotent; the
    options of :class:`oncely.grpc.IdempotencyInterceptor`."""

    def __init__(
        self,
        *,
        store: AsyncStore,
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
            store_method="execute",
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

    async def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = await continuation(handler_call_details)
        parts = unwrap(handler)
        method: str = handler_call_details.method
        if parts is None or not self._s.contract.covers_grpc(method):
            return handler
        behavior, deser, ser = parts

        async def guarded(raw: bytes, context: Any) -> bytes:
            return await self._serve(method, behavior, deser, ser, raw, context)

        return grpc.unary_unary_rpc_method_handler(guarded)

    async def _serve(
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
            return ser(await _call(behavior, deser(raw), context))
        if isinstance(scoped, http.Problem):
            await self._refuse(context, scoped)
        if call_led_already(context, self.store, scoped):
            # Installed twice with one store: the outer interceptor leads this call.
            s.counters.bump("passed_through")
            return ser(await _call(behavior, deser(raw), context))
        fp = http.request_fingerprint("POST", method, "application/grpc", frame(raw))
        run = _Lead(s, behavior, deser, ser, raw, context, (self.store, scoped))
        while True:
            try:
                done = await self.store.execute(scoped, fp, run.action, wait=s.contract.wait)
            except Unstored as u:
                if u.owner is run:
                    return run.answer()
                return await self._replay(context, scoped, u.record)
            except AppFailed as af:
                if af.owner is run:
                    raise af.error from None
                await self._refuse(context, problem_of(af))
            except OncelyError as e:
                if run.answered:
                    # The handler has run: its answer stands even when it could not be
                    # stored (store unreachable, lease lost); a refusal would invite a
                    # retry that runs it again.
                    return run.answer()
                await self._refuse(context, http.Problem.from_error(e))
            if run.led:
                return run.answer()
            return await self._replay(context, scoped, done.value)

    async def _refuse(self, context: Any, problem: http.Problem) -> NoReturn:
        self._s.counters.bump("refused")
        context.set_trailing_metadata(pushback(problem))
        await context.abort(STATUS[problem.grpc_code], problem.detail)
        raise AssertionError("context.abort returned")  # grpc's abort always raises

    async def _replay(self, context: Any, scoped: ScopedKey, record: Any) -> bytes:
        try:
            code, details, message, metadata = read_record(record)
        except OncelyError as e:
            await self._refuse(context, http.Problem.from_error(e))
        self._s.replaying(context, scoped, metadata)
        if code != 0:
            await context.abort(STATUS[code], details)
        return message


def _is_async_handler(behavior: Any) -> bool:
    """grpc.aio's own test: anything else is a sync handler, which grpc runs in its
    thread pool with a sync context (``context.abort`` raising, not a coroutine)."""
    return (
        inspect.isawaitable(behavior)
        or inspect.iscoroutinefunction(behavior)
        or inspect.isasyncgenfunction(behavior)
    )


async def _call(behavior: Callable[[Any, Any], Any], request: Any, context: Any) -> Any:
    if _is_async_handler(behavior):
        out = behavior(request, context)
        if inspect.isawaitable(out):
            out = await out
        return out
    # A sync handler: as grpc.aio runs it, off the event loop, with the sync context
    # (the context variables copied, so a re-entrant call is still seen).
    if _SyncContext is None:
        raise RuntimeError(
            "oncely.grpc.aio: this grpcio has no sync servicer context for a plain `def` "
            "handler on an aio server; make the handler `async def`"
        )
    loop = asyncio.get_running_loop()
    sync_context = _SyncContext(context)
    run = contextvars.copy_context().run
    out = await loop.run_in_executor(None, run, behavior, request, sync_context)
    if inspect.isawaitable(out):  # e.g. an object whose __call__ is async, as before
        out = await out
    return out


class _Lead(Lead):
    async def action(self) -> bytes:
        self.start()
        try:
            with leading_call(self.context, *self.mark):
                answer = await _call(self.behavior, self.deser(self.raw), self.context)
            self.respond(answer)
        except Exception as e:
            self.failed(e)
        return self.finish()
