"""The shared dedup store on Redis: run an action once per scoped key across every
process (and every language) that shares one Redis (SPEC §6).

:class:`RedisStore` has the same ``execute`` / ``execute_sync`` as
:class:`~oncely.IdempotencyStore`; the state lives in Redis (record format v1 of
``redis/README.md``), with an in-process tier in front, so N same-key callers in one
process make one claim. The Rust crate ``oncely-redis`` does the work; this module
runs your function when it says this caller leads (as ``oncely.IdempotencyStore``
does: in a task of its own, keeping the claim until the function has finished), and
waits when it says wait.

Results are stored as bytes in the one result encoding of ``oncely-redis``
(``redis/README.md``, "Result encoding"), so that a Node or Python instance can read
what another one stored:

- ``None`` → "no value", replayed as ``None``;
- ``bytes`` / ``bytearray`` / ``memoryview`` → bytes, read back as ``bytes``;
- JSON data (``dict`` with ``str`` keys, ``list``, ``tuple``, ``str``, ``int`` within
  ±(2**53 - 1), which a Node reader reads exactly, finite
  ``float``, ``bool``, ``None``, exactly these types) → compact JSON, read back with
  ``json.loads`` (so a tuple comes back as a list);
- anything else (``datetime``, ``Decimal``, ``set``, NaN, a lone surrogate, ``dict``
  with non-``str`` keys, subclasses such as ``IntEnum``, ...) cannot be stored without
  changing it: the caller that ran ``fn`` (and callers of this process waiting for it)
  get the value itself, the record says "not storable", and every later caller gets
  :class:`~oncely.ResultNotStoredError` (the action is not run again).

``RedisStore(..., dumps=f, loads=g)`` stores your own types instead: ``f(value)``
returns ``bytes`` or ``str`` and ``g`` gets back the same type (``pickle.dumps`` /
``pickle.loads``, or ``json.dumps(v, default=str)`` / ``json.loads``); ``None`` is
still "no value". A ``dumps`` that raises makes the result "not storable"; a
``loads`` that raises fails the replay with :class:`~oncely.StoreUnavailableError`
(its exception as the cause), and the action is not run again.

The leader gets its own object back; joiners and replays get the decoded copy.
Exceptions raised by ``fn`` are never stored: the claim is released and a later call
(in any process) runs again; callers waiting in this process get the exception
itself, callers in other processes run their own ``fn``.
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Literal, Optional

from ._driver import Driver, wait_step
from ._oncely import (
    RedisLease,
    RedisPending,
    ScopedKey,
    _decode_record,
    _encode_record,
    _RedisStore,
)

__all__ = ["RedisStore", "RedisRecord", "encode_result", "decode_result"]

# Every live store, so that a child made by fork() ends at once the calls the parent had
# in flight (their answers would come to the parent's threads): they raise
# StoreUnavailableError there instead of waiting for ever.
_LIVE: "weakref.WeakSet[RedisStore]" = weakref.WeakSet()


def _end_parents_calls_after_fork() -> None:
    for store in list(_LIVE):
        store._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_end_parents_calls_after_fork)

_JSON_SCALARS = (str, int, float, bool, type(None))
# JavaScript reads every JSON number as a double: beyond this an int would come back
# changed in a Node instance sharing the store, so it is not stored as JSON.
_MAX_SAFE_INT = 2**53 - 1


def _type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _not_json(value: Any) -> Optional[str]:
    """The type name of the first part of ``value`` that JSON would drop or change, or
    None when ``json.loads(json.dumps(value))`` gives it back (tuples as lists)."""
    stack: list[tuple[Any, bool]] = [(value, False)]
    path: set[int] = set()  # the containers being walked: a cycle, not a shared part
    while stack:
        v, leaving = stack.pop()
        if leaving:
            path.discard(id(v))
            continue
        t = type(v)
        if t in _JSON_SCALARS:
            if t is float and (v != v or v in (float("inf"), float("-inf"))):
                return f"float ({v})"
            if t is int and not -_MAX_SAFE_INT <= v <= _MAX_SAFE_INT:
                return "int (beyond 2^53 - 1)"
            if t is str:
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return "str (lone surrogate)"
            continue
        if t is dict or t is list or t is tuple:
            if id(v) in path:
                return f"{t.__qualname__} (cyclic)"
            path.add(id(v))
            stack.append((v, True))
            if t is dict:
                for k in v:
                    if type(k) is not str:
                        return f"dict with {_type_name(k)} keys"
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return "str (lone surrogate)"
                stack.extend((x, False) for x in v.values())
            else:
                stack.extend((x, False) for x in v)
            continue
        return _type_name(v)
    return None


def encode_result(value: Any, dumps: Optional[Callable[[Any], Any]] = None) -> bytes:
    """The stored form of a result (``redis/README.md``, "Result encoding"): "no value"
    for None, the user codec's output when ``dumps`` is given, bytes for bytes-like
    values, compact UTF-8 JSON for JSON data, else a "not storable" record naming the
    type. Never raises for a value that cannot be stored."""
    try:
        return _encode(value, dumps)
    except Exception:
        return _encode_record("not_storable", _type_name(value))


def _not_storable(value: Any) -> bytes:
    """The "not storable" record of a result whose encoding was interrupted."""
    try:
        return _encode_record("not_storable", _type_name(value))
    except Exception:
        return _encode_record("not_storable", "object")


def _encode(value: Any, dumps: Optional[Callable[[Any], Any]]) -> bytes:
    if value is None:
        return _encode_record("no_value")
    if dumps is not None:
        try:
            out = dumps(value)
        except Exception:
            return _encode_record("not_storable", _type_name(value))
        if isinstance(out, (bytes, bytearray, memoryview)):
            return _encode_record("user_bytes", bytes(out))
        if isinstance(out, str):
            try:
                out.encode("utf-8")
            except UnicodeEncodeError:
                return _encode_record("not_storable", _type_name(value))
            return _encode_record("user_text", out)
        return _encode_record("not_storable", _type_name(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _encode_record("bytes", bytes(value))
    bad = _not_json(value)
    if bad is not None:
        return _encode_record("not_storable", bad)
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return _encode_record("not_storable", _type_name(value))
    return _encode_record("json", text)


def decode_result(data: bytes, loads: Optional[Callable[[Any], Any]] = None) -> Any:
    """Reads a stored result back (see :func:`encode_result`). A "not storable" record
    raises ``ResultNotStoredError``; an empty record or an unknown tag raises
    ``StoreUnavailableError``: the record was written by something that does not
    follow the encoding, and it is not guessed at."""
    return _decode_record(bytes(data), loads)


@dataclass(frozen=True)
class RedisRecord:
    """A record as stored in Redis, read by :meth:`RedisStore.get`.

    ``state`` is ``"running"`` (a leader holds or held the claim; ``lease_left`` is
    the seconds left on its lease, 0.0 once it ran out and the next claim takes over)
    or ``"done"`` (``data`` is the stored result record: ``decode_result(data,
    store.loads)`` gives the value, or raises ``ResultNotStoredError`` for a result that
    was not stored: not storable, or over ``max_result_bytes``). ``generation`` is 1 for
    the first claim, +1 for each takeover."""

    state: Literal["running", "done"]
    fingerprint: str
    generation: int
    lease_left: float
    data: Optional[bytes]


def _record(out: Any) -> Optional[RedisRecord]:
    if out is None:
        return None
    if isinstance(out, BaseException):
        raise out
    state, fingerprint, generation, lease_left, data = out
    return RedisRecord(state, fingerprint, generation, lease_left, data)


def _checked(out: Any) -> Any:
    if isinstance(out, BaseException):
        raise out
    return out


class RedisStore(_RedisStore, Driver):
    """A dedup store shared by every process using one Redis.

    ``RedisStore(url, lease=30.0, ttl=86400.0, *, prefix="oncely", connect_timeout=1.0,
    io_timeout=1.0, workers=4, in_progress_retry_after=1.0, dumps=None, loads=None,
    cluster=False, sentinel=None, min_replicas=0, min_replicas_timeout=None,
    connect=False, max_result_bytes=67108864)``:
    ``io_timeout`` bounds each Redis call from the moment it is made (default
    min(1 s, lease/3), at most lease/3); ``url`` is
    ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS), or a list of
    them: with ``cluster=True`` the seed nodes of a Redis Cluster, with
    ``sentinel="<master name>"`` the Sentinels (also written
    ``redis+sentinel://[user:password@]host:port[,host:port...]/master[/db]``);
    ``min_replicas`` makes every claim and completion wait (``WAIT``, up to
    ``min_replicas_timeout``, default io_timeout/2) for that many replicas: a claim
    they did not acknowledge is released and the call raises
    ``StoreUnavailableError`` before ``fn`` runs; ``lease`` is how long a claim lasts
    without renewal (renewed every lease/3 while ``fn`` runs; a crashed leader's key is
    taken over after it); ``ttl`` keeps completed results. Durations are seconds or
    ``timedelta``. Redis unreachable or too slow → ``StoreUnavailableError`` and ``fn``
    does not run. ``dumps`` / ``loads`` (both or neither) store your own types (see the
    module's doc). ``connect=True`` connects and sends ``PING`` in the constructor, so
    a wrong URL, password or TLS setting fails at startup with
    ``StoreUnavailableError`` instead of at the first request. ``max_result_bytes``
    (1 to 512 MiB, default 64 MiB; keep it at or below the server's
    ``proto-max-bulk-len``) caps a stored result (encoded): a larger one is recorded as
    not storable, like a value the codec cannot hold (its caller and this process's
    waiters get the value; later callers ``ResultNotStoredError``; ``fn`` is not run
    again).

    For operators: :meth:`get` / :meth:`remove` read and delete a record by its scoped
    key, :meth:`ping` is a health check, :meth:`counters` counts claims, leads,
    takeovers, replays, remote_waits, leases_lost, abandoned (leads given up without an
    outcome) and unavailable (calls that failed with ``StoreUnavailableError``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # The native __new__ has built the store from the same arguments.
        _LIVE.add(self)

    _method = "RedisStore"

    async def get(self, scoped: ScopedKey) -> Optional[RedisRecord]:
        """The record of ``scoped`` in Redis, or None."""
        return _record(await wait_step(self._get(scoped)))

    def get_sync(self, scoped: ScopedKey) -> Optional[RedisRecord]:
        """The blocking variant of :meth:`get` (the GIL is released while waiting)."""
        return _record(self._get(scoped).wait())

    async def remove(self, scoped: ScopedKey) -> bool:
        """Deletes the record of ``scoped`` (a bad stored result, say), so that the next
        call runs again. Returns True once the record it found is gone; False when there
        was none, when a live lease holds it (its leader may still be running, and a
        second leader must not start meanwhile; once the lease ran out it can be
        removed), or when a new claim replaced it meanwhile (left alone: look at it with
        :meth:`get` before removing again). With ``min_replicas``, a deletion fewer
        replicas acknowledged raises ``StoreUnavailableError`` (gone from the primary,
        but a failover could bring it back: remove it again); a removal that finds no
        record waits for the replicas too, and raises so until they acknowledged the
        deletion."""
        return bool(_checked(await wait_step(self._remove(scoped))))

    def remove_sync(self, scoped: ScopedKey) -> bool:
        """The blocking variant of :meth:`remove`."""
        return bool(_checked(self._remove(scoped).wait()))

    async def ping(self) -> None:
        """Health check: ``PING`` within the I/O timeout, or ``StoreUnavailableError``."""
        _checked(await wait_step(self._ping()))

    def ping_sync(self) -> None:
        """The blocking variant of :meth:`ping`."""
        _checked(self._ping().wait())

    def _ident(self, scoped: ScopedKey) -> Hashable:
        return self.record_key(scoped)

    def _settle_failure(self, lease: RedisLease, exc: Exception) -> RedisPending:
        return lease.fail(exc)

    def _encode(self, value: Any) -> bytes:
        return encode_result(value, self.dumps)

    def _not_storable(self, value: Any) -> bytes:
        return _not_storable(value)

    def _settle_value(self, lease: RedisLease, stored: bytes, value: Any) -> RedisPending:
        return lease.complete(stored, value)
