"""What the ASGI and WSGI adapters share: the settings, the counters, the outcomes an
action hands back through the store when its response is not stored, and the record of
a response. Every decision is the core's (:mod:`oncely.http`)."""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import (
    Any,
    Awaitable,
    Callable,
    Iterator,
    MutableMapping,
    Optional,
    Protocol,
    Sequence,
    TypeVar,
    Union,
    overload,
)

from . import http
from ._codes import Code
from ._oncely import Executed, ScopedKey
from .errors import ArgumentTypeError, LeaderPanickedError, OncelyError

log = logging.getLogger("oncely")

Headers = list[tuple[str, bytes]]
T = TypeVar("T")


class AsyncStore(Protocol):
    """A dedup store as the ASGI middleware uses it (``IdempotencyStore``, ``RedisStore``)."""

    async def execute(
        self, scoped: ScopedKey, fingerprint: str, fn: Callable[[], Any], /, *, wait: bool = True
    ) -> Executed[Any]: ...


class SyncStore(Protocol):
    """A dedup store as the WSGI middleware uses it (``IdempotencyStore``, ``RedisStore``)."""

    def execute_sync(
        self, scoped: ScopedKey, fingerprint: str, fn: Callable[[], Any], /, *, wait: bool = True
    ) -> Executed[Any]: ...


class Store(Protocol):
    """What every dedup store of oncely offers (``IdempotencyStore``, ``RedisStore``):
    type a server's store as ``oncely.Store`` to accept either."""

    @overload
    async def execute(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], Awaitable[T]],
        /,
        *,
        wait: bool = True,
    ) -> Executed[T]: ...

    @overload
    async def execute(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], T],
        /,
        *,
        wait: bool = True,
    ) -> Executed[T]: ...

    def execute_sync(
        self,
        scoped: ScopedKey,
        fingerprint: str,
        fn: Callable[[], T],
        /,
        *,
        wait: bool = True,
    ) -> Executed[T]: ...

    @property
    def ttl(self) -> float:
        """How long a completed result is kept, in seconds."""
        ...


@dataclass(frozen=True)
class Counters:
    """What a middleware has done (a snapshot)."""

    #: Requests passed to the app untouched (not covered, or no key and none required).
    passed_through: int = 0
    #: Requests refused with a problem before the app ran (missing or invalid key, body
    #: too large, reused key, in progress, store unavailable).
    refused: int = 0
    #: Requests whose app ran under a key.
    led: int = 0
    #: Responses stored.
    stored: int = 0
    #: Responses not stored (status, size, an app that raised).
    not_stored: int = 0
    #: Requests answered with another request's response.
    replayed: int = 0


def _wrong_type(field: str, expected: str, got: object) -> ArgumentTypeError:
    return ArgumentTypeError(f"{field} must be {expected}, not {type(got).__name__}", field=field)


def check_options(
    *,
    store: object,
    store_method: str,
    tenant: object,
    callbacks: dict[str, object],
    counters: object,
) -> None:
    """Refuses, when the adapter is built, the options it could only trip over at its
    first request: a store without ``store_method``, a tenant that is neither a ``str``
    nor a callable, a callback that is not callable, counters that are not a
    :class:`CounterSet`."""
    if not callable(getattr(store, store_method, None)):
        raise _wrong_type("store", f"a dedup store with {store_method}()", store)
    if tenant is not None and not isinstance(tenant, str) and not callable(tenant):
        raise _wrong_type("tenant", "a str or a callable", tenant)
    for name, fn in callbacks.items():
        if fn is not None and not callable(fn):
            raise _wrong_type(name, "a callable", fn)
    if counters is not None and not isinstance(counters, CounterSet):
        raise _wrong_type("counters", "a CounterSet", counters)


class CounterSet:
    """The live counters of one middleware (thread-safe); :meth:`snapshot` reads them."""

    _NAMES = ("passed_through", "refused", "led", "stored", "not_stored", "replayed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self._NAMES, 0)

    def bump(self, name: str) -> None:
        with self._lock:
            self._values[name] += 1

    def snapshot(self) -> Counters:
        """The counts so far."""
        with self._lock:
            return Counters(**self._values)


class Unstored(Exception):
    """An action's response that is not stored but was read whole (a 5xx, a 409, ...):
    the leader sends it, the duplicates that waited get it too, and the key is
    released (SPEC §8)."""

    # Read by the stores' failure extraction: never a permanent failure to cache.
    code = Code.UNAVAILABLE

    def __init__(self, owner: object, record: bytes) -> None:
        super().__init__("the response is not stored")
        self.owner = owner
        self.record = record


class Streamed(Exception):
    """An action whose response went over the body cap and was sent as it came: not
    stored, the key is released once it has ended, and a duplicate that waited runs
    the app itself (SPEC §8). ``error`` is what the app raised after it began sending,
    if anything."""

    code = Code.UNAVAILABLE

    def __init__(self, owner: object, error: Optional[BaseException]) -> None:
        super().__init__("the response was streamed, not stored")
        self.owner = owner
        self.error = error


class AppFailed(Exception):
    """The app raised (``error``) while leading: nothing is stored, the key is released,
    the leader's server sees ``error`` and the duplicates that waited get 500
    ``internal`` (the app is not run again for them)."""

    code = Code.UNAVAILABLE

    def __init__(self, owner: object, error: BaseException) -> None:
        super().__init__(f"the app raised {type(error).__name__}")
        self.owner = owner
        self.error = error


class Settings:
    """The options both middlewares take (see :class:`oncely.asgi.IdempotencyMiddleware`)."""

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
        request_cap: int,
        stored_headers: Optional[Sequence[str]],
        fingerprint: Optional[Callable[[Any, bytes], str]],
        route: Optional[Callable[[Any], Optional[str]]],
        on_replay: Optional[Callable[[Any, ScopedKey], None]],
        counters: Optional[CounterSet],
    ) -> None:
        check_options(
            store=store,
            store_method=store_method,
            tenant=tenant,
            callbacks={"fingerprint": fingerprint, "route": route, "on_replay": on_replay},
            counters=counters,
        )
        self.contract = http.ServerConfig(
            methods=methods,
            required=required,
            wait=wait,
            body_cap=body_cap,
            request_cap=request_cap,
            stored_headers=stored_headers,
        )
        self.tenant = tenant
        self.fingerprint = fingerprint
        self.route = route
        self.on_replay = on_replay
        self.counters = counters if counters is not None else CounterSet()

    def tenant_of(self, request: Any) -> str:
        t = self.tenant
        if t is None:
            return http.DEFAULT_TENANT
        if isinstance(t, str):
            return t
        return t(request)

    def record(
        self,
        status: int,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
        *,
        stored: bool = True,
    ) -> bytes:
        """The record of a response: with the headers the contract stores, or, for a
        response that is not stored (``stored=False``: it only reaches the duplicates
        waiting now), with every header it shares."""
        keep = self.contract.stores_header if stored else self.contract.shares_header
        kept: Headers = []
        for name, value in headers:
            # bytes by the specs; a server that takes str as well (uvicorn) sends them.
            n = header_bytes(name).decode("latin-1").lower()
            if keep(n):
                kept.append((n, header_bytes(value)))
        return http.encode_response(status, kept, body)

    def settle(
        self,
        run: Any,
        method: str,
        status: int,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes,
    ) -> bytes:
        """The record of ``run``'s whole response to a ``method`` request, counted:
        returned when its status is stored, else raised as :class:`Unstored` (it still
        reaches the waiters). Its body is the one sent: none to a HEAD, nor with a 1xx,
        204 or 304 (``http.has_content``). Marks ``run.answered``."""
        if not http.has_content(method, status):
            body = b""
        storable = http.storable_status(status)
        record = self.record(status, headers, body, stored=storable)
        run.answered = True
        if not storable:
            self.counters.bump("not_stored")
            raise Unstored(run, record)
        self.counters.bump("stored")
        return record

    def scoped(
        self, request: Any, method: str, route: str, key: str
    ) -> Union[ScopedKey, http.Problem]:
        """The scoped key of a request, or the problem to answer with: a tenant no key
        can be scoped by is the server's fault (500 ``tenant-unusable``)."""
        tenant = self.tenant_of(request)
        try:
            return http.scope(tenant, method, route, key)
        except OncelyError as e:
            if getattr(e, "field", None) == "tenant":
                return http.Problem.tenant_unusable(str(e))
            return http.Problem.from_error(e)

    def replayed(self, request: Any, scoped: ScopedKey) -> None:
        self.counters.bump("replayed")
        if self.on_replay is not None:
            try:
                self.on_replay(request, scoped)
            except Exception:
                log.exception("oncely: the on_replay hook raised")


_LEADS = "oncely.leads"
"""The key, in an ASGI scope or a WSGI environ, of the leads the request is in right now
(:class:`_Mark`). A mark on the request itself, not on the context: tasks, threads and
in-process calls started by the app inherit a context, and a request they make is
another request, which must go through the store."""


class _Mark:
    """One lead of a request: the store and scoped key, the middleware leading it, the
    other middleware passing the request on under it right now (through any copy), and
    whether it still runs (a deep copy of the scope keeps the mark past its lead)."""

    __slots__ = ("store", "scoped", "leader", "passing", "active")

    def __init__(self, store: object, scoped: ScopedKey, leader: object) -> None:
        self.store = store
        self.scoped = scoped
        self.leader = leader
        self.passing: list[object] = []
        self.active = True

    def __deepcopy__(self, memo: dict[int, object]) -> _Mark:
        # A deep copy of the scope (hypercorn's ProxyFixMiddleware) keeps the mark itself:
        # it holds a store, which cannot be copied, and it is the same lead.
        return self


_PASSED = "oncely.passed"
"""The key, in a scope or environ, of the (middleware, lead) pairs passing that very
mapping on to their app right now (:class:`_Passed`). A value of the mapping, not a
shared list: a copy made meanwhile below them (by the handler, a task, a thread) keeps
it; the mapping itself loses it once their app has returned."""


class _Passed:
    __slots__ = ("pairs",)

    def __init__(self, pairs: tuple[tuple[object, _Mark], ...]) -> None:
        self.pairs = pairs

    def __deepcopy__(self, memo: dict[int, object]) -> _Passed:
        return self  # middleware and leads cannot be copied, and they are the same


_PASSING_NOW: ContextVar[tuple[tuple[object, _Mark], ...]] = ContextVar(
    "oncely_passing_now", default=()
)
"""The (middleware, lead) pairs the code running now was passed on under: the handler
and the tasks it starts, even once the pass has ended."""


def _has(pairs: tuple[tuple[object, _Mark], ...], me: object, mark: _Mark) -> bool:
    return any(p is me and m is mark for p, m in pairs)


class _Pass:
    """One middleware passing a request on under a lead: ``with`` it around the app's
    call. The app gets the request itself (what it changes in it stays visible above),
    stamped while the call runs."""

    __slots__ = ("me", "mark", "request", "token")

    def __init__(self, me: object, mark: _Mark, request: MutableMapping[str, Any]) -> None:
        self.me = me
        self.mark = mark
        self.request = request
        self.token: Optional[Token[tuple[tuple[object, _Mark], ...]]] = None

    def __enter__(self) -> None:
        stamp: Optional[_Passed] = self.request.get(_PASSED)
        pairs = () if stamp is None else stamp.pairs
        self.request[_PASSED] = _Passed(pairs + ((self.me, self.mark),))
        self.mark.passing.append(self.me)
        self.token = _PASSING_NOW.set(_PASSING_NOW.get() + ((self.me, self.mark),))

    def __exit__(self, *exc: object) -> None:
        self.left()
        self.ended()

    def left(self) -> None:
        """The app's call has returned: the code running on is no longer in the pass."""
        if self.token is not None:
            _PASSING_NOW.reset(self.token)
            self.token = None

    def ended(self) -> None:
        """The app has returned (a WSGI body: consumed, failed or closed): the request
        is no longer being passed on. Only this pass's own pair leaves the stamp: passes
        of one mapping to sibling apps (a layer fanning out) end in any order."""
        stamp: Optional[_Passed] = self.request.get(_PASSED)
        if stamp is not None:
            pairs = tuple(pm for pm in stamp.pairs if not (pm[0] is self.me and pm[1] is self.mark))
            if pairs:
                self.request[_PASSED] = _Passed(pairs)
            else:
                self.request.pop(_PASSED, None)
        for i, p in enumerate(self.mark.passing):
            if p is self.me:
                del self.mark.passing[i]
                return


def pass_led(
    request: MutableMapping[str, Any], store: object, scoped: ScopedKey, me: object
) -> Optional[_Pass]:
    """How middleware ``me`` passes ``request`` on to its app under a lead it is in
    already, or ``None``: the request goes through the store. Another middleware of the
    same store leads the same scoped key for it: the middleware wrapped twice, on an app
    and on a sub-app mounted in it (through a dispatcher that copies the scope, as
    hypercorn's, too). Asking the store again from inside that lead would be refused as
    re-entrant.

    A request that reaches the middleware leading it again, or one passing it on right
    now (a layer between the mounts sending a copy alongside), or that carries the stamp
    of that pass (a copy made meanwhile) or runs in its context (the handler, or a task
    it started, sending its request or a copy back through the app, at any time), is
    another run of it from inside the lead and goes through the store (refused as
    re-entrant, or waiting for the lead). The request passed on again once the app has
    returned (a retrying middleware between the two mounts) passes again; so does a
    thread's, which carries no context. Another scoped key leads a key of its own."""
    marks: list[_Mark] = request.get(_LEADS, [])
    mark = next((m for m in marks if m.active and m.store is store and m.scoped == scoped), None)
    if mark is None or mark.leader is me or any(p is me for p in mark.passing):
        return None
    if _has(_PASSING_NOW.get(), me, mark):
        return None
    stamp: Optional[_Passed] = request.get(_PASSED)
    if stamp is not None and _has(stamp.pairs, me, mark):
        return None
    return _Pass(me, mark, request)


@contextmanager
def leading(
    request: MutableMapping[str, Any], store: object, scoped: ScopedKey, me: object
) -> Iterator[None]:
    """Marks ``request`` as led by ``me`` in ``store`` under ``scoped`` while the block runs (see
    :func:`pass_led`): around the app's run inside the action, which outlives a caller
    that stops waiting for it. The mark is taken off when the block ends, so that a
    request mapping used again later is not taken for the one in progress."""
    leads: Optional[list[_Mark]] = request.get(_LEADS)
    if leads is None:
        leads = request[_LEADS] = []
    mark = _Mark(store, scoped, me)
    leads.append(mark)
    try:
        yield
    finally:
        mark.active = False
        for i, m in enumerate(leads):
            if m is mark:
                del leads[i]
                break


_CALL_LEADS: ContextVar[tuple[tuple[object, ScopedKey], ...]] = ContextVar(
    "oncely_grpc_leads", default=()
)
"""The (store, scoped key) pairs the gRPC call running in this context is led under: an
interceptor between two of ours may hand the handler a wrapped ServicerContext
(OpenTelemetry's instrumentation does)."""

_CALL_CONTEXTS: dict[int, list[tuple[object, ScopedKey, object]]] = {}
"""The same by the id of the call's ServicerContext and of its invocation metadata: an
interceptor between two of ours may run the rest of the call on another thread (a
deadline) without the context of execution, and wrap the ServicerContext too (a wrapper
delegates ``invocation_metadata()``, the same object on grpcio's server). An entry holds
both objects while its lead runs, so their ids are not reused meanwhile."""


def call_led_already(context: Any, store: object, scoped: ScopedKey) -> bool:
    """:func:`pass_led` for a gRPC call: the interceptor is installed twice with one
    store, and the outer one leads this call (seen by its context of execution, by its
    ServicerContext or by its invocation metadata; a call the handler makes is a new
    RPC, with none of them)."""
    if any(s is store and k == scoped for s, k in _CALL_LEADS.get()):
        return True
    try:
        # Held until the look-ups are done: a metadata tuple made for this call alone
        # (grpc.aio makes one per call) must not free its id for another call's lead.
        metadata: object = context.invocation_metadata()
    except Exception:
        metadata = None
    ids = (id(context),) if metadata is None else (id(context), id(metadata))
    found = any(s is store and k == scoped for i in ids for s, k, _ in _CALL_CONTEXTS.get(i, ()))
    del metadata
    return found


@contextmanager
def leading_call(context: Any, store: object, scoped: ScopedKey) -> Iterator[None]:
    """:func:`leading` for a gRPC call (see :func:`call_led_already`)."""
    token = _CALL_LEADS.set(_CALL_LEADS.get() + ((store, scoped),))
    try:
        metadata: object = context.invocation_metadata()
    except Exception:
        metadata = None
    ids = (id(context),) if metadata is None else (id(context), id(metadata))
    mark = (store, scoped, (context, metadata))
    for i in ids:
        _CALL_CONTEXTS.setdefault(i, []).append(mark)
    try:
        yield
    finally:
        _CALL_LEADS.reset(token)
        for i in ids:
            entries = _CALL_CONTEXTS.get(i, [])
            for j, m in enumerate(entries):
                if m is mark:
                    del entries[j]
                    break
            if not entries:
                _CALL_CONTEXTS.pop(i, None)


def header_bytes(value: object) -> bytes:
    """A header value as bytes: as the ASGI and WSGI specs give it (bytes; a Latin-1
    ``str``), or, from a server or a test that gives something else (an int), its text."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return str(value).encode("latin-1", "replace")


def replay_head(record: bytes, method: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers (with ``content-length`` and ``idempotent-replayed: true``) and
    body of a stored record, replayed to a ``method`` request. Raises
    ``StoreUnavailableError`` if it is not a record."""
    status, headers, body, _trailers = http.decode_response(record)
    out = [(n.encode("latin-1"), v) for n, v in headers]
    # No body, so no length: a HEAD's would be its GET's (RFC 9110 §8.6), never in a
    # 1xx or 204, and a 304's describes the representation, not this empty body.
    if http.has_content(method, status):
        out.append((b"content-length", str(len(body)).encode()))
    out.append((http.REPLAYED_HEADER.encode(), http.REPLAYED_VALUE.encode()))
    return status, out, body


def problem_head(problem: http.Problem) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Status, headers and body of a problem answer."""
    body = problem.body()
    headers = [(n.encode(), v.encode()) for n, v in problem.headers()]
    headers.append((b"content-length", str(len(body)).encode()))
    return problem.status, headers, body


def problem_of(error: BaseException) -> http.Problem:
    """The problem for an error raised by the store, or, for a duplicate whose leader's
    app raised (:class:`AppFailed`), 500 ``internal`` (the app is not run again)."""
    if isinstance(error, OncelyError):
        return http.Problem.from_error(error)
    name = type(error.error).__name__ if isinstance(error, AppFailed) else type(error).__name__
    return http.Problem.from_error(
        LeaderPanickedError(f"the request with this key failed in the app ({name})")
    )
