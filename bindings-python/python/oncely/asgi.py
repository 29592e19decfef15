"""``IdempotencyMiddleware``: the server contract (SPEC §8) in front of any ASGI app
(Starlette, FastAPI, Litestar, Quart, ...), on an :class:`~oncely.IdempotencyStore` or a
:class:`~oncely.RedisStore`::

    app.add_middleware(IdempotencyMiddleware, store=IdempotencyStore(), tenant=tenant_of)

A covered request (POST and PATCH by default) must carry an ``Idempotency-Key``; its
body is read once (at most ``request_cap`` bytes) and handed on to the app. The app
runs at most once per key, tenant, method and route: a retry, or a duplicate that
arrives while the first runs, gets the first response byte for byte with
``Idempotent-Replayed: true``. 2xx and the final 4xx are stored (the record of
:func:`oncely.http.encode_response`, readable by every oncely adapter); a 5xx, a
response over ``body_cap`` (sent as it comes: streaming responses are not stored) or an
app that raises is not, and a retry runs the app again. The app runs in a task of its
own: a client that goes away does not stop it, and its response is stored as usual.
Pure ASGI: no dependency on any framework.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, MutableMapping, Optional, Sequence, Union

from . import http
from ._adapter import (
    AppFailed,
    AsyncStore,
    Counters,
    CounterSet,
    Settings,
    Streamed,
    Unstored,
    header_bytes,
    leading,
    pass_led,
    problem_head,
    problem_of,
    replay_head,
)
from ._oncely import ScopedKey
from .errors import OncelyError

__all__ = ["IdempotencyMiddleware", "Counters", "CounterSet", "starlette_route"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_KEY = http.KEY_HEADER.encode()


def starlette_route(scope: Scope) -> Optional[str]:
    """The route template (``"/orders/{id}"``) of the Starlette or FastAPI route that
    matches the request, read from ``scope["app"]``'s routes; ``None`` when there is
    none (the middleware then scopes the key by the path)."""
    routes = getattr(scope.get("app"), "routes", None)
    return _match(routes, scope, "") if routes else None


def _match(routes: Any, scope: Scope, prefix: str) -> Optional[str]:
    for route in routes:
        try:
            match, child = route.matches(scope)
        except Exception:
            continue
        if getattr(match, "name", "") != "FULL":
            continue
        path = prefix + str(getattr(route, "path", ""))
        sub = getattr(route, "routes", None)
        if sub:
            inner = _match(sub, {**scope, **child}, path)
            return inner if inner is not None else path
        return path
    return None


class IdempotencyMiddleware:
    """Makes the covered requests of an ASGI app idempotent by their ``Idempotency-Key``.

    - ``store``: an :class:`~oncely.IdempotencyStore` (one process) or a
      :class:`~oncely.RedisStore` (shared by every process of the service).
    - ``tenant``: who the caller is — a string, or a function of the ASGI scope (e.g.
      the authenticated principal). Default: one tenant for every caller
      (``"default"``), so two callers that pick the same key share one response; give
      a function whenever callers are not one party.
    - ``methods`` (default POST, PATCH), ``required`` (a covered request without a key
      is 400; ``False``: passed through), ``wait`` (a duplicate waits for the first and
      replays it; ``False``: 409 + ``Retry-After``), ``body_cap`` (largest response
      stored, default 1 MiB), ``request_cap`` (largest request body, default 1 MiB:
      larger is 413), ``stored_headers`` (default content-type, content-encoding,
      location, etag; ``set-cookie`` only when listed).
    - ``route``: a function of the scope giving the route template the key is scoped by;
      default :func:`starlette_route`, else the path.
    - ``fingerprint``: a function of the scope and the body replacing
      :func:`oncely.http.request_fingerprint`.
    - ``on_replay``: called with the scope and the scoped key of every replay (so a
      replay is not counted twice in business metrics).
    - ``counters``: a :class:`CounterSet` to count into (default: a new one, read with
      :meth:`counters`).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: AsyncStore,
        tenant: Union[str, Callable[[Scope], str], None] = None,
        methods: Optional[Sequence[str]] = None,
        required: bool = True,
        wait: bool = True,
        body_cap: int = http.DEFAULT_BODY_CAP,
        request_cap: int = http.DEFAULT_REQUEST_CAP,
        stored_headers: Optional[Sequence[str]] = None,
        route: Optional[Callable[[Scope], Optional[str]]] = None,
        fingerprint: Optional[Callable[[Scope, bytes], str]] = None,
        on_replay: Optional[Callable[[Scope, ScopedKey], None]] = None,
        counters: Optional[CounterSet] = None,
    ) -> None:
        self.app = app
        self.store = store
        self._s = Settings(
            store=store,
            store_method="execute",
            tenant=tenant,
            methods=methods,
            required=required,
            wait=wait,
            body_cap=body_cap,
            request_cap=request_cap,
            stored_headers=stored_headers,
            fingerprint=fingerprint,
            route=route if route is not None else starlette_route,
            on_replay=on_replay,
            counters=counters,
        )

    def counters(self) -> Counters:
        """What this middleware has done so far."""
        return self._s.counters.snapshot()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        s = self._s
        method: str = scope["method"]
        if not s.contract.covers(method):
            s.counters.bump("passed_through")
            await self.app(scope, receive, send)
            return
        headers: Sequence[tuple[bytes, bytes]] = scope.get("headers") or ()
        values = [v for n, v in headers if n.lower() == _KEY]
        decision = s.contract.read_key(method, values)
        if decision is None:
            s.counters.bump("passed_through")
            await self.app(scope, receive, send)
            return
        if isinstance(decision, http.Problem):
            await self._refuse(send, decision)
            return
        body = await self._read_body(scope, headers, receive, send)
        if body is None:
            return
        raw_path = scope.get("raw_path")
        path = raw_path.decode("latin-1") if raw_path else scope["path"]
        route = s.route(scope) if s.route is not None else None
        scoped = s.scoped(scope, method, route or path, decision)
        if isinstance(scoped, http.Problem):
            await self._refuse(send, scoped)
            return
        passing = pass_led(scope, self.store, scoped, self)
        if passing is not None:
            # Here again with the same store and key (wrapped twice): the outer one leads.
            s.counters.bump("passed_through")
            with passing:
                await self.app(scope, _body_again(body, receive), send)
            return
        if s.fingerprint is not None:
            fp = s.fingerprint(scope, body)
        else:
            query = scope.get("query_string") or b""
            target = f"{path}?{query.decode('latin-1')}" if query else path
            ctype = next((v for n, v in headers if n.lower() == b"content-type"), None)
            fp = http.request_fingerprint(
                method, target, None if ctype is None else ctype.decode("latin-1"), body
            )
        run = _Lead(self.app, s, scope, body, receive, send, (self.store, scoped, self))
        while True:
            try:
                done = await self.store.execute(scoped, fp, run.action, wait=s.contract.wait)
            except Unstored as u:
                if u.owner is run:
                    await run.finish()
                else:
                    await self._replay(send, scope, scoped, u.record)
                return
            except Streamed as st:
                if st.owner is run:
                    if st.error is not None:
                        raise st.error from None
                    return
                continue  # the key is free again: lead or wait anew
            except AppFailed as af:
                if af.owner is run:
                    raise af.error from None
                await self._refuse(send, problem_of(af))
                return
            except OncelyError as e:
                if run.answered:
                    # The app has run: its response is the answer even when it could
                    # not be stored (store unreachable, lease lost). A problem instead
                    # would invite a retry, which would run the app again.
                    await run.finish()
                else:
                    await self._refuse(send, http.Problem.from_error(e))
                return
            if run.led:
                await run.finish()
            else:
                await self._replay(send, scope, scoped, done.value)
            return

    async def _read_body(
        self, scope: Scope, headers: Sequence[tuple[bytes, bytes]], receive: Receive, send: Send
    ) -> Optional[bytes]:
        """The whole request body, or ``None`` when a problem was sent instead."""
        contract = self._s.contract
        for name, value in headers:
            if name.lower() == b"content-length" and contract.declares_too_large(
                header_bytes(value)
            ):
                # Refused before its body is read (SPEC §8): no 100 Continue.
                await self._refuse(send, contract.too_large())
                return None
        cap = contract.request_cap
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            kind = message["type"]
            if kind == "http.disconnect":
                # The client went away before sending its request: nothing ran.
                await self._refuse(
                    send, http.Problem.request_body_unreadable("the client disconnected")
                )
                return None
            if kind != "http.request":
                continue
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                await self._refuse(send, contract.too_large())
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _refuse(self, send: Send, problem: http.Problem) -> None:
        self._s.counters.bump("refused")
        status, headers, body = problem_head(problem)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _replay(self, send: Send, scope: Scope, scoped: ScopedKey, record: Any) -> None:
        try:
            status, headers, body = replay_head(record, scope["method"])
        except OncelyError as e:
            await self._refuse(send, http.Problem.from_error(e))
            return
        self._s.replayed(scope, scoped)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# Messages an app may send before its response that are not part of it.
_INFORMATIONAL = frozenset({"http.response.early_hint", "http.response.push"})


def _body_again(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` (read already) once, then the server's messages."""
    given = False

    async def again() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _event_stream(start: Message) -> bool:
    for name, value in start.get("headers") or ():
        if name.lower() == b"content-type":
            return http.is_event_stream(value.decode("latin-1"))
    return False


class _Lead:
    """One request's run of the app under its key: the app gets the body read once,
    and its response is captured (up to the body cap) for the store."""

    def __init__(
        self,
        app: ASGIApp,
        s: Settings,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        mark: tuple[object, ScopedKey, object],
    ) -> None:
        self.app = app
        self.s = s
        self.scope = scope
        # (store, scoped key, middleware): the request's mark while the app runs.
        self.mark = mark
        self.body: Optional[bytes] = body
        self.real_receive = receive
        self.real_send = send
        self.led = False
        self.start: Optional[Message] = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.complete = False
        self.streaming = False
        # Set once the app has produced a whole response (the answer, stored or not).
        self.answered = False
        # What the app raised after its response was whole, raised once it is sent.
        self.late_error: Optional[BaseException] = None

    async def action(self) -> bytes:
        self.led = True
        counters = self.s.counters
        counters.bump("led")
        try:
            with leading(self.scope, *self.mark):
                await self.app(self.scope, self.receive, self.send)
        except Exception as e:
            if self.streaming:
                counters.bump("not_stored")
                raise Streamed(self, e) from None
            if self.start is None or not self.complete:
                counters.bump("not_stored")
                raise AppFailed(self, e) from None
            # The response was whole before the app raised (e.g. in a background task
            # run after it): it is the answer, as a server would have sent it, and
            # the app is not run again for a retry.
            self.late_error = e
        except BaseException as e:
            # Cancelled (the loop shutting down) or interrupted after the response was
            # whole (in a background task): as any failure after it, the response is
            # the answer. Abandoning the lease would let a retry run the app again.
            if self.streaming or self.start is None or not self.complete:
                raise
            self.late_error = e
        if self.streaming:
            counters.bump("not_stored")
            raise Streamed(self, None)
        if self.start is None or not self.complete:
            counters.bump("not_stored")
            raise AppFailed(self, RuntimeError("the app returned without a whole response"))
        headers = self.start.get("headers") or ()
        status = int(self.start["status"])
        return self.s.settle(self, self.scope["method"], status, headers, b"".join(self.chunks))

    async def receive(self) -> Message:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.real_receive()

    async def send(self, message: Message) -> None:
        if self.streaming:
            await self.real_send(message)
            return
        kind = message["type"]
        if kind in _INFORMATIONAL and self.start is None:
            # A 1xx (103 Early Hints) or a push before the response: not the response,
            # never stored (SPEC §8); it goes to the client, the response is captured.
            await self.real_send(message)
            return
        if self.complete or (kind == "http.response.start" and self.start is not None):
            # What a server refuses (a second start, a message after the last body)
            # is refused here too, rather than stored in place of the first response.
            raise RuntimeError(f"unexpected ASGI message {kind!r}: the response has begun or ended")
        if kind == "http.response.start":
            # Headers are an Iterable: read once, here, for the event-stream check, the
            # client and the record alike.
            message = {**message, "headers": list(message.get("headers") or ())}
            self.start = message
            if message.get("trailers") or _event_stream(message):
                # Trailers are not stored; an event stream is sent as it is produced
                # (it may stay open with a few small events): both pass through.
                await self._stream()
            return
        if kind == "http.response.body" and self.start is not None:
            chunk = message.get("body", b"")
            self.size += len(chunk)
            self.chunks.append(chunk)
            self.complete = not message.get("more_body", False)
            if not self.s.contract.body_fits(self.size):
                await self._stream()
            return
        await self._stream()
        await self.real_send(message)

    async def _stream(self) -> None:
        """Sends what was captured and passes the rest of the response through."""
        self.streaming = True
        if self.start is not None:
            await self.real_send(self.start)
        if self.chunks:
            body = b"".join(self.chunks)
            self.chunks = []
            await self.real_send(
                {"type": "http.response.body", "body": body, "more_body": not self.complete}
            )

    async def finish(self) -> None:
        """Sends the app's own response (every header it set) to the leader's client once
        the store has settled its key (a retry sent after this answer arrived never
        meets the key still held: after a 5xx it runs the app again), then raises what
        the app raised after that response was whole, if anything. So work the app does
        after its response (a background task) delays it."""
        assert self.start is not None
        await self.real_send(self.start)
        await self.real_send({"type": "http.response.body", "body": b"".join(self.chunks)})
        if self.late_error is not None:
            raise self.late_error
