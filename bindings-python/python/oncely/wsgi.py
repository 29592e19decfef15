"""``IdempotencyMiddleware``: the server contract (SPEC §8) in front of any WSGI app
(Flask, Django, Pyramid, ...), on an :class:`~oncely.IdempotencyStore` or a
:class:`~oncely.RedisStore`, with ``execute_sync``::

    app.wsgi_app = IdempotencyMiddleware(app.wsgi_app, store=IdempotencyStore(),
                                         tenant=tenant_of, route=flask_route(app))

The same behaviour as :mod:`oncely.asgi`: a covered request (POST and PATCH by default)
must carry an ``Idempotency-Key``; its body is read once and handed on
(``wsgi.input``); the app runs at most once per key, tenant, method and route, and a
retry or a duplicate that waited gets the first response byte for byte with
``Idempotent-Replayed: true``. A response over ``body_cap`` is written to the client as
it comes (through the ``write`` callable of ``start_response``, so the key stays claimed
until it has been sent) and is not stored. The app runs on the request's thread; a
duplicate waits on its own thread (the GIL released). No dependency on any framework.
"""

from __future__ import annotations

import io
from http import HTTPStatus
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union
from urllib.parse import quote

from . import http
from ._adapter import (
    AppFailed,
    Counters,
    CounterSet,
    Settings,
    Streamed,
    SyncStore,
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

__all__ = ["IdempotencyMiddleware", "Counters", "CounterSet", "flask_route"]

Environ = dict[str, Any]
StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


def flask_route(app: Any) -> Callable[[Environ], Optional[str]]:
    """A ``route`` function for a Flask app: the rule (``"/orders/<id>"``) that matches
    the request, ``None`` when none does (the middleware then scopes by the path)."""

    def route(environ: Environ) -> Optional[str]:
        try:
            rule, _args = app.url_map.bind_to_environ(environ).match(return_rule=True)
        except Exception:
            return None
        return str(rule.rule)

    return route


def _status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def _read_up_to(stream: Any, n: int) -> bytes:
    """Up to ``n`` bytes of ``stream``: fewer only at its end. One ``read(n)`` may give
    fewer before the end (a raw stream, one chunk of a chunked body)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        part = stream.read(n - got)
        if not part:
            break
        parts.append(bytes(part))
        got += len(part)
    return b"".join(parts)


def _text_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
    return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers]


class IdempotencyMiddleware:
    """Makes the covered requests of a WSGI app idempotent by their ``Idempotency-Key``.

    Takes the options of :class:`oncely.asgi.IdempotencyMiddleware`, with the WSGI
    ``environ`` where that one takes the ASGI scope (``tenant``, ``route``,
    ``fingerprint``, ``on_replay``); the store is used through ``execute_sync``. Without
    ``route`` the key is scoped by the path; :func:`flask_route` gives Flask's rules.
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        store: SyncStore,
        tenant: Union[str, Callable[[Environ], str], None] = None,
        methods: Optional[Sequence[str]] = None,
        required: bool = True,
        wait: bool = True,
        body_cap: int = http.DEFAULT_BODY_CAP,
        request_cap: int = http.DEFAULT_REQUEST_CAP,
        stored_headers: Optional[Sequence[str]] = None,
        route: Optional[Callable[[Environ], Optional[str]]] = None,
        fingerprint: Optional[Callable[[Environ, bytes], str]] = None,
        on_replay: Optional[Callable[[Environ, ScopedKey], None]] = None,
        counters: Optional[CounterSet] = None,
    ) -> None:
        self.app = app
        self.store = store
        self._s = Settings(
            store=store,
            store_method="execute_sync",
            tenant=tenant,
            methods=methods,
            required=required,
            wait=wait,
            body_cap=body_cap,
            request_cap=request_cap,
            stored_headers=stored_headers,
            fingerprint=fingerprint,
            route=route,
            on_replay=on_replay,
            counters=counters,
        )

    def counters(self) -> Counters:
        """What this middleware has done so far."""
        return self._s.counters.snapshot()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        s = self._s
        method: str = environ["REQUEST_METHOD"]
        if not s.contract.covers(method):
            s.counters.bump("passed_through")
            return self.app(environ, start_response)
        # A WSGI server joins a header sent twice with ", ", which no valid key contains.
        value = environ.get("HTTP_IDEMPOTENCY_KEY")
        values = [] if value is None else [value.encode("latin-1")]
        decision = s.contract.read_key(method, values)
        if decision is None:
            s.counters.bump("passed_through")
            return self.app(environ, start_response)
        if isinstance(decision, http.Problem):
            return self._refuse(start_response, decision)
        body = self._read_body(environ)
        if isinstance(body, http.Problem):
            return self._refuse(start_response, body)
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        # PEP 3333 gives the path decoded, as latin-1 text: its bytes, re-quoted.
        raw = (environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")).encode("latin-1")
        path = quote(raw, safe="/:@!$&'()*+,;=-._~%")
        route = s.route(environ) if s.route is not None else None
        scoped = s.scoped(environ, method, route or path, decision)
        if isinstance(scoped, http.Problem):
            return self._refuse(start_response, scoped)
        passing = pass_led(environ, self.store, scoped, self)
        if passing is not None:
            # Here again with the same store and key (wrapped twice): the outer one leads.
            s.counters.bump("passed_through")
            passing.__enter__()
            try:
                result = self.app(environ, start_response)
            except BaseException:
                passing.__exit__()
                raise
            passing.left()
            # Still passed on while the body runs: until it is consumed, fails or closes.
            return _PassedOn(result, passing.ended)
        if s.fingerprint is not None:
            fp = s.fingerprint(environ, body)
        else:
            query = environ.get("QUERY_STRING", "")
            target = f"{path}?{query}" if query else path
            fp = http.request_fingerprint(method, target, environ.get("CONTENT_TYPE") or None, body)
        run = _Lead(self.app, s, environ, start_response, (self.store, scoped, self))
        while True:
            try:
                done = self.store.execute_sync(scoped, fp, run.action, wait=s.contract.wait)
            except Unstored as u:
                if u.owner is run:
                    return run.finish()
                return self._replay(start_response, environ, scoped, u.record)
            except Streamed as st:
                if st.owner is run:
                    if st.error is not None:
                        raise st.error from None
                    return []
                continue  # the key is free again: lead or wait anew
            except AppFailed as af:
                if af.owner is run:
                    raise af.error from None
                return self._refuse(start_response, problem_of(af))
            except OncelyError as e:
                if run.answered:
                    # The app has run: its response is the answer even when it could
                    # not be stored (store unreachable, lease lost). A problem instead
                    # would invite a retry, which would run the app again.
                    return run.finish()
                return self._refuse(start_response, http.Problem.from_error(e))
            except BaseException:
                run.close_deferred()
                raise
            if run.led:
                return run.finish()
            return self._replay(start_response, environ, scoped, done.value)

    def _read_body(self, environ: Environ) -> Union[bytes, http.Problem]:
        contract = self._s.contract
        cap = contract.request_cap
        stream = environ.get("wsgi.input")
        terminated = bool(environ.get("wsgi.input_terminated"))
        raw = environ.get("CONTENT_LENGTH")
        declared = b"" if raw is None or raw == "" else header_bytes(raw)
        if contract.declares_too_large(declared):
            return contract.too_large()
        length = 0
        if declared and not terminated:
            # A WSGI server may pass on any value (wsgiref does): one that declares no
            # length is refused, not read by (Python's int() would take "+5" or "5_000").
            n = http.declared_length(declared)
            if n is None:
                return http.Problem.request_body_unreadable("the Content-Length is not a length")
            length = n
        try:
            if stream is None:
                return b""
            if terminated:
                # The server ends the input where the body ends (a chunked request,
                # de-chunked): a Content-Length beside it says nothing (RFC 9112 §6.3,
                # the transfer coding wins), so the body is read to its end.
                data = _read_up_to(stream, cap + 1)
            elif length:
                data = _read_up_to(stream, length)
            else:
                data = b""
        except Exception as e:
            return http.Problem.request_body_unreadable(str(e) or type(e).__name__)
        if len(data) > cap:
            return contract.too_large()
        if length and len(data) < length:
            return http.Problem.request_body_unreadable("the body ended early")
        return bytes(data)

    def _refuse(self, start_response: StartResponse, problem: http.Problem) -> list[bytes]:
        self._s.counters.bump("refused")
        status, headers, body = problem_head(problem)
        start_response(_status_line(status), _text_headers(headers))
        return [body]

    def _replay(
        self, start_response: StartResponse, environ: Environ, scoped: ScopedKey, record: Any
    ) -> list[bytes]:
        try:
            status, headers, body = replay_head(record, environ["REQUEST_METHOD"])
        except OncelyError as e:
            return self._refuse(start_response, http.Problem.from_error(e))
        self._s.replayed(environ, scoped)
        start_response(_status_line(status), _text_headers(headers))
        return [body]


class _PassedOn:
    """The body of an app a request was passed on to under a lead (``pass_led``): the
    request is being passed on until the body is consumed, fails or is closed (the app
    may run while its body is iterated)."""

    def __init__(self, body: Iterable[bytes], passed: Callable[[], None]) -> None:
        self.body = body
        self.passed: Optional[Callable[[], None]] = passed

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self.body
        finally:
            self.done()

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            self.done()

    def done(self) -> None:
        passed, self.passed = self.passed, None
        if passed is not None:
            passed()


class _Lead:
    """One request's run of the app under its key, on the request's thread: the
    response is captured (up to the body cap) for the store; past the cap it is
    written to the client as it comes, before the action ends."""

    def __init__(
        self,
        app: WSGIApp,
        s: Settings,
        environ: Environ,
        start_response: StartResponse,
        mark: tuple[object, ScopedKey, object],
    ) -> None:
        self.app = app
        self.s = s
        self.environ = environ
        # (store, scoped key, middleware): the request's mark while the app runs.
        self.mark = mark
        self.real_start = start_response
        self.led = False
        self.status: Optional[str] = None
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.write: Optional[Callable[[bytes], object]] = None  # set once streaming
        # Set once the app has produced a whole response (the answer, stored or not).
        self.answered = False
        # What the app's close() raised after its body was whole, raised once it is sent.
        self.late_error: Optional[BaseException] = None
        # The close() of a whole, storable body, called once the server has sent it.
        self.deferred_close: Optional[Callable[[], object]] = None

    def start_response(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], object]:
        if self.write is not None:
            return self.real_start(status, headers, exc_info)
        self.status, self.headers = status, list(headers)
        if any(n.lower() == "content-type" and http.is_event_stream(v) for n, v in self.headers):
            # An event stream is sent as it is produced (it may stay open with a few
            # small events), never read ahead to the cap: not stored, like a body over it.
            self.write = self.real_start(status, self.headers, exc_info)
        return self.take

    def take(self, chunk: bytes) -> None:
        if self.write is not None:
            self.write(chunk)
            return
        self.chunks.append(chunk)
        self.size += len(chunk)
        if not self.s.contract.body_fits(self.size):
            assert self.status is not None
            self.write = self.real_start(self.status, self.headers)
            data, self.chunks = b"".join(self.chunks), []
            self.write(data)

    def action(self) -> bytes:
        self.led = True
        counters = self.s.counters
        counters.bump("led")
        try:
            with leading(self.environ, *self.mark):
                result = self.app(self.environ, self.start_response)
                try:
                    for chunk in result:
                        if chunk:
                            self.take(chunk)
                except BaseException:
                    close = getattr(result, "close", None)
                    if close is not None:
                        close()
                    raise
            close = getattr(result, "close", None)
            if close is not None and self.write is None and self._storable():
                # The body is whole and will be stored: close() (after-response work,
                # e.g. werkzeug's call_on_close) runs once the server has sent it, as
                # without the middleware, instead of delaying the answer.
                self.deferred_close = close
            elif close is not None:
                try:
                    close()
                except Exception as e:
                    if self.write is not None or self.status is None:
                        raise
                    # The body was whole before close() raised: it is the answer, as a
                    # server would have sent it, and the app is not run again.
                    self.late_error = e
        except Exception as e:
            counters.bump("not_stored")
            if self.write is not None:
                raise Streamed(self, e) from None
            raise AppFailed(self, e) from None
        if self.write is not None:
            counters.bump("not_stored")
            raise Streamed(self, None)
        if self.status is None:
            counters.bump("not_stored")
            raise AppFailed(self, RuntimeError("the app returned without calling start_response"))
        try:
            code = self._code()
            raw = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in self.headers]
            method = self.environ["REQUEST_METHOD"]
            return self.s.settle(self, method, code, raw, b"".join(self.chunks))
        except BaseException:
            self.close_deferred()
            raise

    def _code(self) -> int:
        """The status code of the app's status line (``ValueError`` when it has none)."""
        return int((self.status or "").split(" ", 1)[0])

    def _storable(self) -> bool:
        try:
            return http.storable_status(self._code())
        except Exception:  # no code, or one out of range: settle refuses it
            return False

    def close_deferred(self) -> None:
        close, self.deferred_close = self.deferred_close, None
        if close is not None:
            close()

    def finish(self) -> Iterable[bytes]:
        """The app's own response (every header it set), for the leader's client; what
        its close() raised after the body was whole is raised once the body is sent."""
        assert self.status is not None
        try:
            self.real_start(self.status, self.headers)
        except BaseException:
            # The server refused the response: it will never see (nor close) the body.
            self.close_deferred()
            raise
        body = [b"".join(self.chunks)]
        if self.deferred_close is not None:
            return _CloseAfter(body, self.deferred_close)
        if self.late_error is None:
            return body
        return _RaiseOnClose(body, self.late_error)


class _RaiseOnClose:
    """A response body whose ``close()`` (called by the server once the body is sent)
    raises ``error``."""

    def __init__(self, body: list[bytes], error: BaseException) -> None:
        self.body = body
        self.error = error

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        raise self.error


class _CloseAfter:
    """A response body whose ``close()`` (called by the server once the body is sent)
    calls the app's own ``close()``."""

    def __init__(self, body: list[bytes], close: Callable[[], object]) -> None:
        self.body = body
        self._close = close

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.body)

    def close(self) -> None:
        self._close()
