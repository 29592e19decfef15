#!/usr/bin/env python3
"""Writes the shared cross-language test vectors of oncely (tests/vectors/*.json).

Every expected value here is computed INDEPENDENTLY of the Rust code: from the
formulas and tables of /SPEC.md (sections 2-6) and the documented behaviour of the
public API, re-implemented in plain Python (standard library only). The Rust test
(core/tests/vectors.rs) and the Python and Node suites then check the library against
these files. See README.md beside this script for the format.

Run from anywhere:  python3 tests/vectors/generate.py
Re-running it gives byte-identical files; to check that the committed files are
current:  python3 tests/vectors/generate.py && git diff --exit-code tests/vectors
"""

import calendar
import decimal
import hashlib
import json
import math
import os
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# Integers in the vectors stay within what an IEEE double holds exactly, so that
# JavaScript's JSON.parse reads them unchanged.
MAX_SAFE = 2**53 - 1

# --------------------------------------------------------------------------------------
# 1. Backoff (SPEC §2; core/src/backoff.rs `delay_with_seed`, core/src/rand.rs `unit`)
# --------------------------------------------------------------------------------------

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64_mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def unit(seed, n):
    """Uniform in [0, 1): SplitMix64 finalizer of seed + n*GOLDEN (wrapping), top 53 bits."""
    z = splitmix64_mix((seed + n * GOLDEN) & MASK64)
    return (z >> 11) / float(1 << 53)


def backoff_delay_ms(policy, n, seed):
    """Delay in whole ms after the n-th failed attempt (n >= 1; 0 is taken as 1, for the
    growth and the jitter draw alike)."""
    n = max(n, 1)
    base = float(policy["base_delay_ms"])
    cap = float(policy["max_delay_ms"])
    mult = float(policy["multiplier"])
    jitter = float(policy["jitter"])
    if base == 0.0:
        capped = 0.0
    else:
        try:
            growth = math.pow(mult, n - 1)
        except OverflowError:  # Python raises where IEEE gives +inf
            growth = math.inf
        raw = base * growth
        capped = cap if math.isnan(raw) else min(raw, cap)
    u = 0.0 if jitter == 0.0 else jitter * (2.0 * unit(seed, n) - 1.0)
    ms = math.floor(capped * (1.0 + u) + 0.5)
    return max(ms, 0)


DEFAULT_POLICY = {
    "max_attempts": 3,
    "base_delay_ms": 20,
    "max_delay_ms": 1000,
    "multiplier": 2.0,
    "jitter": 0.2,
    "seed": None,
}


def policy(**over):
    p = dict(DEFAULT_POLICY)
    p.update(over)
    return p


def backoff_case(comment, pol, attempts, sequence=False):
    seed = pol["seed"]
    if seed is None:
        assert pol["jitter"] == 0.0, "an unseeded case must have jitter 0"
        seed = 0  # unused: u is 0
    assert 0 <= seed <= MAX_SAFE
    delays = []
    for n in attempts:
        d = backoff_delay_ms(pol, n, seed)
        assert d <= MAX_SAFE
        # Jitter is applied after the cap: never beyond max_delay * (1 + jitter).
        assert d <= math.floor(pol["max_delay_ms"] * (1 + pol["jitter"]) + 0.5)
        delays.append({"failed_attempt": n, "delay_ms": d})
    case = {"comment": comment, "policy": pol, "delays": delays}
    if sequence:
        case["sequence_ms"] = [
            backoff_delay_ms(pol, n, seed) for n in range(1, pol["max_attempts"])
        ]
    return case


def invalid_policy(comment, pol, field):
    return {"comment": comment, "policy": pol, "error": {"kind": "invalid_argument", "field": field}}


def backoff_cases():
    c = []
    one_to_12 = list(range(1, 13))
    huge = [1_000_000_000, 4_294_967_295]
    c.append(backoff_case("SPEC defaults, no jitter: 20, 40, 80 ... capped at 1000",
                          policy(jitter=0.0), one_to_12 + huge, sequence=True))
    for seed in [0, 1, 7, 42, 123456789, 2**32 - 1, 2**32, MAX_SAFE]:
        c.append(backoff_case(f"SPEC defaults with seed {seed}: about 20 then 40 ms (+-20 %)",
                              policy(seed=seed), one_to_12 + huge, sequence=True))
    c.append(backoff_case("5 attempts, seed 7 (the doc example of RetryPolicy)",
                          policy(max_attempts=5, seed=7), [1, 2, 3, 4], sequence=True))
    c.append(backoff_case("one attempt only: no delays in the sequence",
                          policy(max_attempts=1, seed=3), [1], sequence=True))
    c.append(backoff_case("huge attempt numbers give max_delay, jitter applied after the cap",
                          policy(seed=99, jitter=0.5), [30, 31, 64, 1025, 1_000_000_000,
                                                        4_294_967_295]))
    c.append(backoff_case("base 0: every delay is 0, with or without jitter",
                          policy(base_delay_ms=0, seed=5), [1, 2, 3, 1_000_000_000]))
    c.append(backoff_case("base 0 and max 0",
                          policy(base_delay_ms=0, max_delay_ms=0, jitter=0.0), [1, 2, 1000]))
    c.append(backoff_case("multiplier 1: constant delay",
                          policy(base_delay_ms=100, multiplier=1.0, jitter=0.0),
                          [1, 2, 3, 1_000_000_000]))
    c.append(backoff_case("multiplier 1 with jitter: varies around the base",
                          policy(base_delay_ms=100, multiplier=1.0, seed=11),
                          [1, 2, 3, 4, 5, 1_000_000_000]))
    c.append(backoff_case("multiplier 1.5, no jitter: 337.5 rounds half up to 338",
                          policy(base_delay_ms=100, max_delay_ms=5000, multiplier=1.5, jitter=0.0),
                          list(range(1, 16))))
    c.append(backoff_case("base 1, multiplier 2.5: 2.5 rounds half up to 3, not to even",
                          policy(base_delay_ms=1, max_delay_ms=100000, multiplier=2.5, jitter=0.0),
                          list(range(1, 14))))
    c.append(backoff_case("base equal to max: capped from the first delay",
                          policy(base_delay_ms=500, max_delay_ms=500, jitter=0.0), [1, 2, 3]))
    c.append(backoff_case("base equal to max, jittered",
                          policy(base_delay_ms=500, max_delay_ms=500, seed=2024), [1, 2, 3]))
    c.append(backoff_case("multiplier 10 up to a one-day cap",
                          policy(base_delay_ms=1000, max_delay_ms=86_400_000, multiplier=10.0,
                                 jitter=0.0), list(range(1, 9)) + [1_000_000_000]))
    c.append(backoff_case("jitter 0.5, seed 31337",
                          policy(base_delay_ms=100, max_delay_ms=10000, jitter=0.5, seed=31337),
                          list(range(1, 11))))
    c.append(backoff_case("jitter 0.99 may bring a delay close to 0 and close to double",
                          policy(base_delay_ms=1000, max_delay_ms=1000, jitter=0.99, seed=8),
                          list(range(1, 21))))
    c.append(backoff_case("tiny base: 1 ms with jitter 0.9 rounds to 0..2",
                          policy(base_delay_ms=1, max_delay_ms=1, jitter=0.9, seed=77),
                          list(range(1, 21))))
    # Invalid policies: the error names the field (SPEC §2 "Validation").
    c.append(invalid_policy("max_attempts counts the first attempt: 0 is invalid",
                            policy(max_attempts=0), "max_attempts"))
    c.append(invalid_policy("jitter must be below 1", policy(jitter=1.0), "jitter"))
    c.append(invalid_policy("jitter must be below 1", policy(jitter=1.5), "jitter"))
    c.append(invalid_policy("jitter must not be negative", policy(jitter=-0.1), "jitter"))
    c.append(invalid_policy("multiplier must be at least 1", policy(multiplier=0.5), "multiplier"))
    c.append(invalid_policy("multiplier must be at least 1", policy(multiplier=0.0), "multiplier"))
    c.append(invalid_policy("multiplier must be at least 1", policy(multiplier=-2.0), "multiplier"))
    c.append(invalid_policy("base_delay must not exceed max_delay",
                            policy(base_delay_ms=2000, max_delay_ms=1000), "base_delay"))
    c.append(invalid_policy("base_delay must not exceed max_delay",
                            policy(base_delay_ms=1, max_delay_ms=0), "base_delay"))
    c.append(invalid_policy("a negative base delay is rejected", policy(base_delay_ms=-1),
                            "base_delay"))
    c.append(invalid_policy("a negative max delay is rejected", policy(max_delay_ms=-1000),
                            "max_delay"))
    # Several bad fields: the host's numbers are converted first (base_delay, then
    # max_delay), then validate() checks max_attempts, jitter, multiplier, then
    # base_delay <= max_delay. The first that fails is named.
    c.append(invalid_policy("bad max_attempts and jitter: max_attempts is named",
                            policy(max_attempts=0, jitter=1.5), "max_attempts"))
    c.append(invalid_policy("bad jitter and multiplier: jitter is named",
                            policy(jitter=1.0, multiplier=0.5), "jitter"))
    c.append(invalid_policy("bad multiplier and base_delay > max_delay: multiplier is named",
                            policy(multiplier=0.5, base_delay_ms=2000, max_delay_ms=1000),
                            "multiplier"))
    c.append(invalid_policy("bad max_attempts and base_delay > max_delay: max_attempts",
                            policy(max_attempts=0, base_delay_ms=2000, max_delay_ms=1000),
                            "max_attempts"))
    c.append(invalid_policy("a negative base_delay is named before a bad max_attempts "
                            "(host numbers are converted first)",
                            policy(max_attempts=0, base_delay_ms=-1), "base_delay"))
    c.append(invalid_policy("a negative max_delay is named before a bad jitter",
                            policy(jitter=2.0, max_delay_ms=-1), "max_delay"))
    c.append(invalid_policy("negative base_delay and max_delay: base_delay is named",
                            policy(base_delay_ms=-5, max_delay_ms=-1), "base_delay"))
    c.append(invalid_policy("every field bad: base_delay is named",
                            policy(max_attempts=0, base_delay_ms=-1, max_delay_ms=-1,
                                   multiplier=0.0, jitter=-1.0), "base_delay"))
    # n = 0 is taken as 1; the exponent is IEEE pow, not repeated multiplication.
    c.append(backoff_case("failed_attempt 0 is taken as 1",
                          policy(seed=42), [0, 1, 2]))
    c.append(backoff_case("failed_attempt 0 without jitter: the base delay",
                          policy(jitter=0.0, base_delay_ms=70), [0, 1]))
    c.append(backoff_case("multiplier^(n-1) is pow(multiplier, n-1), one rounding: after the "
                          "35th failure 1.7^34 x 9026 ms gives 617673054570 (34 multiplications "
                          "give 617673054569)",
                          policy(base_delay_ms=9026, max_delay_ms=10**13, multiplier=1.7,
                                 jitter=0.0), [1, 2, 10, 34, 35]))
    c.append(backoff_case("pow again: 1.7^37 x 1704 ms after the 38th failure",
                          policy(base_delay_ms=1704, max_delay_ms=10**13, multiplier=1.7,
                                 jitter=0.0), [38]))
    c.append(backoff_case("the growth overflows to infinity, then the cap applies",
                          policy(base_delay_ms=1000, max_delay_ms=10**13, multiplier=10.0,
                                 jitter=0.0), [300, 309, 310, 400]))
    c.append(backoff_case("base 0 with the largest jitter: still 0",
                          policy(base_delay_ms=0, max_delay_ms=1000, jitter=0.99, seed=1),
                          [0, 1, 2, 4_294_967_295]))
    return c


# --------------------------------------------------------------------------------------
# 2. Classification (SPEC §3 table)
# --------------------------------------------------------------------------------------

CODES = [
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
]


def spec_classify(code, safe, rereads, transient_internal, server_delay=None):
    """The SPEC §3 table, row by row. Returns (retryable, rule name)."""
    if (code == "ABORTED" and safe and not rereads and isinstance(server_delay, dict)
            and "after_ms" in server_delay):
        # In progress (409 + Retry-After): a keyed call may always resend.
        return True, "in_progress_keyed"
    if code == "UNAVAILABLE":  # yes, if safe
        return (True, "transient_safe") if safe else (False, "unsafe_to_resend")
    if code == "RESOURCE_EXHAUSTED":  # yes (rejected before executing)
        return True, "rate_limited"
    if code == "DEADLINE_EXCEEDED":  # only if safe (and the budget allows, §4)
        return (True, "attempt_timed_out") if safe else (False, "unsafe_to_resend")
    if code == "ABORTED":  # only if rereads
        return (True, "conflict_rereads") if rereads else (False, "conflict_needs_reread")
    if code in ("INTERNAL", "UNKNOWN"):  # no; opt-in for declared transient AND safe
        if transient_internal and safe:
            return True, "declared_transient"
        return False, "server_error"
    if code in ("INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "UNAUTHENTICATED",
                "FAILED_PRECONDITION", "UNIMPLEMENTED", "ALREADY_EXISTS", "OUT_OF_RANGE",
                "CANCELLED"):
        return False, "permanent"
    if code == "DATA_LOSS":
        return False, "data_loss"
    if code == "OK":  # not a failure at all
        return False, "not_an_error"
    raise ValueError(code)


def classification_cases():
    c = []
    for code in CODES:
        for safe in (False, True):
            for rereads in (False, True):
                for ti in (False, True):
                    retryable, rule = spec_classify(code, safe, rereads, ti)
                    c.append({"code": code, "safe": safe, "rereads": rereads,
                              "transient_internal": ti, "retryable": retryable, "rule": rule})
    # A server delay changes only ABORTED (the in-progress answer); a "do not retry"
    # changes no classification (the loop obeys it afterwards, §4).
    for code in ("ABORTED", "UNAVAILABLE", "INTERNAL"):
        for sd in ({"after_ms": 1000}, "do_not_retry"):
            for safe in (False, True):
                for rereads in (False, True):
                    for ti in (False, True):
                        retryable, rule = spec_classify(code, safe, rereads, ti, sd)
                        c.append({"code": code, "safe": safe, "rereads": rereads,
                                  "transient_internal": ti, "server_delay": sd,
                                  "retryable": retryable, "rule": rule})
    return c


# --------------------------------------------------------------------------------------
# 3. HTTP status -> code (the table in the doc of `Code::from_http`)
# --------------------------------------------------------------------------------------

HTTP_EXACT = {
    400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
    404: "NOT_FOUND", 408: "DEADLINE_EXCEEDED", 409: "ABORTED", 412: "FAILED_PRECONDITION",
    429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL", 501: "UNIMPLEMENTED",
    502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED",
}


def http_code(status):
    if status in HTTP_EXACT:
        return HTTP_EXACT[status]
    if 200 <= status <= 299:
        return "OK"
    if 400 <= status <= 499:
        return "FAILED_PRECONDITION"
    if 500 <= status <= 599:
        return "INTERNAL"
    return "UNKNOWN"  # 1xx, 3xx, anything outside 100..=599


def http_cases():
    statuses = [0, 99, 100, 101, 199, 200, 201, 202, 204, 299, 300, 301, 302, 304, 399,
                400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412, 413, 415,
                418, 422, 425, 428, 429, 431, 451, 498, 499, 500, 501, 502, 503, 504, 505,
                507, 511, 599, 600, 999, 65535]
    return [{"status": s, "code": http_code(s)} for s in statuses]


# --------------------------------------------------------------------------------------
# 4. Retry-After and grpc-retry-pushback-ms
# --------------------------------------------------------------------------------------

def utc(y, mo, d, h, mi, s):
    return calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0))


RA = "Retry-After"
PB = "grpc-retry-pushback-ms"


def retry_after_cases():
    c = []
    t_2015 = utc(2015, 10, 21, 7, 28, 0)  # Wed, 21 Oct 2015 07:28:00 GMT
    now = t_2015 - 120

    def delay(comment, value, now, at_or_secs, kind="date"):
        if kind == "secs":
            ms = at_or_secs * 1000
        else:
            # The hand-written date must name the right day of the week.
            wday = calendar.weekday(*time.gmtime(at_or_secs)[:3])
            assert value.strip(" \t").startswith(calendar.day_abbr[wday]), (value, wday)
            ms = max(at_or_secs - now, 0) * 1000
        assert ms <= MAX_SAFE
        c.append({"comment": comment, "header": RA, "value": value, "now": now, "delay_ms": ms})

    def error(comment, value, now, header=RA, field="retry_after"):
        case = {"comment": comment, "header": header, "value": value}
        if header == RA:
            case["now"] = now
        case["error"] = {"kind": "invalid_argument", "field": field}
        c.append(case)

    delay("delta-seconds", "120", now, 120, "secs")
    delay("delta-seconds zero: retry at once", "0", now, 0, "secs")
    delay("delta-seconds: one day", "86400", now, 86400, "secs")
    delay("delta-seconds with leading zeros (1*DIGIT)", "007", now, 7, "secs")
    delay("surrounding whitespace (OWS) is ignored", "  5 ", now, 5, "secs")
    delay("IMF-fixdate, 2 minutes ahead", "Wed, 21 Oct 2015 07:28:00 GMT", now, t_2015)
    delay("IMF-fixdate, the RFC 9110 example date, one second ahead",
          "Sun, 06 Nov 1994 08:49:37 GMT", utc(1994, 11, 6, 8, 49, 36),
          utc(1994, 11, 6, 8, 49, 37))
    delay("IMF-fixdate on 29 February of a leap year", "Mon, 29 Feb 2016 00:00:00 GMT",
          utc(2016, 2, 28, 23, 0, 0), utc(2016, 2, 29, 0, 0, 0))
    delay("IMF-fixdate in year 9999", "Fri, 31 Dec 9999 23:59:59 GMT", now,
          utc(9999, 12, 31, 23, 59, 59))
    delay("obsolete RFC 850 date", "Wednesday, 21-Oct-15 07:28:00 GMT", now, t_2015)
    delay("obsolete RFC 850 date, the RFC 9110 example",
          "Sunday, 06-Nov-94 08:49:37 GMT", utc(1994, 11, 6, 8, 0, 0),
          utc(1994, 11, 6, 8, 49, 37))
    delay("obsolete asctime date", "Wed Oct 21 07:28:00 2015", now, t_2015)
    delay("obsolete asctime date with a one-digit day", "Sun Nov  6 08:49:37 1994",
          utc(1994, 11, 6, 8, 49, 0), utc(1994, 11, 6, 8, 49, 37))
    delay("a date equal to now: 0", "Wed, 21 Oct 2015 07:28:00 GMT", t_2015, t_2015)
    delay("a date in the past: 0", "Wed, 21 Oct 2015 07:28:00 GMT", t_2015 + 3600, t_2015)
    delay("a date long in the past: 0", "Thu, 01 Jan 1970 00:00:00 GMT", now, 0)
    delay("asctime in the past: 0", "Sun Nov  6 08:49:37 1994", now,
          utc(1994, 11, 6, 8, 49, 37))
    delay("a valid IMF-fixdate before 1970 is a past date: 0",
          "Fri, 01 Jan 1960 00:00:00 GMT", now, utc(1960, 1, 1, 0, 0, 0))
    # RFC 9110 §5.6.7: a two-digit year that appears more than 50 years in the future
    # is the most recent past year with those digits: in 2015, "69" is 1969, not 2069.
    delay("RFC 850 two-digit year more than 50 years ahead is in the past century: 0",
          "Tuesday, 21-Oct-69 07:28:00 GMT", now, utc(1969, 10, 21, 7, 28, 0))
    delay("RFC 850 two-digit year exactly 50 years ahead stays in this century",
          "Wednesday, 21-Oct-65 07:28:00 GMT", now, utc(2065, 10, 21, 7, 28, 0))
    delay("RFC 850 two-digit year 51 years ahead is in the past century: 0",
          "Friday, 21-Oct-66 07:28:00 GMT", now, utc(1966, 10, 21, 7, 28, 0))
    delay("RFC 850 year 00 in 2015 is 2000: in the past, 0",
          "Saturday, 01-Jan-00 00:00:00 GMT", now, utc(2000, 1, 1, 0, 0, 0))
    delay("RFC 850 two-digit year of the current year",
          "Thursday, 22-Oct-15 07:28:00 GMT", now, utc(2015, 10, 22, 7, 28, 0))
    # A leap second: RFC 9110 allows second 60; 07:28:60 is the instant of 07:29:00.
    delay("second 60 (a leap second) is accepted: 07:28:60 is 07:29:00",
          "Wed, 21 Oct 2015 07:28:60 GMT", now, t_2015 + 60)
    delay("whitespace is SP and HTAB only: tabs around the value are ignored",
          "\t5\t", now, 5, "secs")
    delay("spaces around an IMF-fixdate are ignored", "  Wed, 21 Oct 2015 07:28:00 GMT ",
          now, t_2015)
    delay("huge delta-seconds that still fit: 10^11 s", "99999999999", now, 99_999_999_999,
          "secs")
    delta_2_64 = str(2**64)
    c.append({"comment": "delta-seconds beyond 2^64 - 1 saturate: a delay longer than any "
                         "deadline (at least 2^53 - 1 ms)",
              "header": RA, "value": delta_2_64, "now": now, "delay_ms_at_least": MAX_SAFE})
    c.append({"comment": "a thousand-digit delta-seconds saturates too",
              "header": RA, "value": "9" * 1000, "now": now, "delay_ms_at_least": MAX_SAFE})
    for value, why in [
        ("Thu, 21 Oct 2015 07:28:00 GMT", "IMF-fixdate with the wrong day of the week"),
        ("Thursday, 21-Oct-15 07:28:00 GMT", "RFC 850 date with the wrong day of the week"),
        ("Thu Oct 21 07:28:00 2015", "asctime date with the wrong day of the week"),
        ("Wed, 21 Oct 2015 07:28:61 GMT", "second 61"),
        ("Wed, 21 Oct 2015 07:60:00 GMT", "minute 60"),
        ("wed, 21 oct 2015 07:28:00 gmt", "names are case-sensitive"),
        ("Wed,  21 Oct 2015 07:28:00 GMT", "two spaces after the comma"),
        ("Wed, 21 Oct 15 07:28:00 GMT", "IMF-fixdate with a two-digit year"),
        ("\n5", "a line break is not optional whitespace"),
        ("5\r", "a carriage return is not optional whitespace"),
        ("\u00a05", "a non-breaking space is not optional whitespace"),
        ("\u20075", "a figure space is not optional whitespace"),
        ("\uff15", "a full-width digit"),
        ("5 5", "two numbers"),
        ("soon", "not a number or a date"),
        ("", "empty"),
        ("   ", "only whitespace"),
        ("1.5", "delta-seconds are whole seconds"),
        ("-5", "delta-seconds are not negative"),
        ("+5", "no sign allowed"),
        ("120s", "no unit allowed"),
        ("0x10", "decimal only"),
        ("Wed, 21 Oct 2015 07:28:00", "IMF-fixdate without GMT"),
        ("Wed, 21 Oct 2015 07:28:00 PST", "only GMT is allowed"),
        ("2015-10-21T07:28:00Z", "ISO 8601 is not an HTTP-date"),
        ("Wed, 32 Oct 2015 07:28:00 GMT", "day 32"),
        ("Wed, 21 Oct 2015 24:00:00 GMT", "hour 24"),
        ("Sun, 29 Feb 2015 00:00:00 GMT", "29 February of a common year"),
        ("Wed, 21 Foo 2015 07:28:00 GMT", "no such month"),
    ]:
        error(f"garbage: {why}", value, now)
    # grpc-retry-pushback-ms: non-negative integer = delay in ms; negative = do not retry.
    for value, ms, comment in [("250", 250, "pushback in milliseconds"),
                               ("0", 0, "pushback 0: retry at once"),
                               ("86400000", 86_400_000, "pushback of a day"),
                               (" 100 ", 100, "surrounding whitespace is ignored"),
                               ("\t7\t", 7, "tabs around the value are ignored"),
                               ("-0", 0, "-0 is the integer 0, not negative: retry at once"),
                               ("-000", 0, "-000 is 0 too"),
                               ("007", 7, "leading zeros"),
                               ("1000000000000000", 10**15, "a very long pushback: 10^15 ms")]:
        c.append({"comment": comment, "header": PB, "value": value, "delay_ms": ms})
    for value in ["-1", "-250", "-01", " -5 ", "-99999999999999999999999"]:
        c.append({"comment": "a negative pushback means: do not retry", "header": PB,
                  "value": value, "do_not_retry": True})
    c.append({"comment": "a pushback beyond 2^64 - 1 ms saturates", "header": PB,
              "value": "9" * 30, "delay_ms_at_least": MAX_SAFE})
    for value, why in [("abc", "not a number"), ("", "empty"), ("1.5", "not an integer"),
                       ("-", "a sign alone"), ("--1", "two signs"), ("+5", "a plus sign"),
                       ("10ms", "a unit"), ("\n5", "a line break"),
                       ("\u00a05", "a non-breaking space"), ("0x10", "hexadecimal"),
                       ("1e3", "an exponent"), ("1 000", "a space inside")]:
        error(f"garbage pushback: {why}", value, None, PB, "grpc-retry-pushback-ms")
    return c


# --------------------------------------------------------------------------------------
# 5. Idempotency keys (SPEC §5; docs of IdempotencyKey::parse/derive, ScopedKey)
# --------------------------------------------------------------------------------------

KEY_CHARS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def key_valid(s):
    return 8 <= len(s) <= 64 and all(ch in KEY_CHARS for ch in s)


def derive_key(business_id, operation):
    """SHA-256("oncely-key-v1" || u64be(len b) || b || u64be(len o) || o), first 16 bytes,
    as a UUID with version 8 and the RFC 9562 variant. Lengths are UTF-8 byte counts."""
    h = hashlib.sha256(b"oncely-key-v1")
    for part in (business_id, operation):
        raw = part.encode("utf-8")
        h.update(struct.pack(">Q", len(raw)))
        h.update(raw)
    b = bytearray(h.digest()[:16])
    b[6] = (b[6] & 0x0F) | 0x80  # version 8
    b[8] = (b[8] & 0x3F) | 0x80  # variant 10xx
    x = b.hex()
    return f"{x[0:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:32]}"


SCOPE_SAFE = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._/-")


def pct(part):
    return "".join(chr(b) if b in SCOPE_SAFE else "%%%02X" % b for b in part.encode("utf-8"))


def scoped_key(tenant, method, key):
    return f"v1:{pct(tenant)}:{pct(method)}:{key}"


def keys_cases():
    c = []

    def parse(comment, key, valid=None, error=None):
        if valid is None:
            valid = key_valid(key)
        case = {"op": "parse", "comment": comment, "key": key}
        if valid:
            case["valid"] = True
        elif key == "":
            case["error"] = {"kind": "missing_key"}
        else:
            case["error"] = {"kind": "invalid_argument", "field": "idempotency_key"}
        c.append(case)

    parse("a UUID v4 fits", "0f8fad5b-d9cb-469f-a165-70867728950e")
    parse("7 characters: too short", "abcdefg")
    parse("8 characters: shortest accepted", "abcdefgh")
    parse("64 characters: longest accepted", "k" * 64)
    parse("65 characters: too long", "k" * 65)
    parse("all allowed characters", "AZaz09_-")
    parse("only underscores", "________")
    parse("only hyphens", "--------")
    parse("digits only", "1234567890")
    parse("empty: the write has no key", "")
    for ch, name in [(" ", "space"), (".", "dot"), (":", "colon"), ("/", "slash"),
                     ("+", "plus"), ("=", "equals"), ("~", "tilde"), ("%", "percent"),
                     ("{", "brace"), ("\t", "tab"), ("\n", "newline"), ("\u0000", "NUL"),
                     ("é", "e with acute (non-ASCII)"), ("\u0430", "Cyrillic a (homoglyph)"),
                     ("😀", "emoji")]:
        parse(f"disallowed character: {name}", "order42" + ch + "x")
    parse("non-ASCII only, 4 characters but 8 bytes", "éééé")
    parse("non-ASCII only, 8 characters", "éééééééé")
    parse("a full-width digit is not an ASCII digit", "order\uff14\uff12xx")

    def derive(comment, b, o):
        case = {"op": "derive", "comment": comment, "business_id": b, "operation": o}
        if b == "":
            case["error"] = {"kind": "invalid_argument", "field": "business_id"}
        elif o == "":
            case["error"] = {"kind": "invalid_argument", "field": "operation"}
        else:
            k = derive_key(b, o)
            assert key_valid(k)
            case["key"] = k
        c.append(case)

    derive("the doc example", "order-42", "charge")
    derive("another operation on the same business id", "order-42", "refund")
    derive("another business id", "order-43", "charge")
    derive("length-prefixed: ('a', 'bc') ...", "a", "bc")
    derive("... and ('ab', 'c') differ", "ab", "c")
    derive("a separator in the input does not collide: ('a:b', 'c') ...", "a:b", "c")
    derive("... and ('a', 'b:c')", "a", "b:c")
    derive("one character each", "x", "y")
    derive("unicode: lengths are UTF-8 bytes", "订单-42", "支付")
    derive("emoji", "😀", "🎉")
    derive("NUL bytes are data", "a\u0000b", "c")
    derive("spaces and punctuation", "Order #42 / EU", "charge (retry-safe)")
    derive("long input", "b" * 1000, "o" * 300)
    derive("empty business id", "", "charge")
    derive("empty operation", "order-42", "")
    derive("both empty: business_id is named first", "", "")

    k = "order-42-charge"

    def scope(comment, tenant, method, key=k):
        case = {"op": "scope", "comment": comment, "tenant": tenant, "method": method, "key": key}
        if key == "":
            case["error"] = {"kind": "missing_key"}
        elif not key_valid(key):
            case["error"] = {"kind": "invalid_argument", "field": "idempotency_key"}
        elif tenant == "" or len(tenant.encode("utf-8")) > 1024:
            case["error"] = {"kind": "invalid_argument", "field": "tenant"}
        elif method == "" or len(method.encode("utf-8")) > 1024:
            case["error"] = {"kind": "invalid_argument", "field": "method"}
        else:
            case["scoped"] = scoped_key(tenant, method, key)
        c.append(case)

    scope("plain parts are kept", "acme", "CreateOrder")
    scope("the doc example: '.', '/' and '-' are kept", "acme", "/shop.Orders/Create")
    scope("':' in the tenant is escaped ...", "a:b", "c")
    scope("... so it cannot collide with ':' in the method", "a", "b:c")
    scope("'%' is escaped, so it never stands for itself", "50%", "m")
    scope("an encoded-looking input is escaped again", "a%3Ab", "c")
    scope("spaces", "acme corp", "Create Order")
    scope("braces (Redis hash tags) are escaped", "{tag}", "m{x}")
    scope("'~' and '_' : only [A-Za-z0-9._/-] are kept", "a~b_c", "x")
    scope("unicode: every UTF-8 byte escaped, upper-case hex", "café", "注文")
    scope("emoji", "😀", "m")
    scope("control characters", "a\u0000b\tc\n", "m\u007f")
    scope("a key with '_' and '-' is kept as is", "t", "m", "AZaz09_-")
    scope("1024-byte tenant: longest accepted", "t" * 1024, "m")
    scope("1024-byte method: longest accepted", "t", "m" * 1024)
    scope("512 two-byte characters are 1024 bytes: accepted", "é" * 512, "m")
    scope("1025-byte tenant is rejected", "t" * 1025, "m")
    scope("1025-byte method is rejected", "t", "m" * 1025)
    scope("513 two-byte characters are 1026 bytes: rejected", "é" * 513, "m")
    scope("empty tenant: never scope by the key alone", "", "m")
    scope("empty method", "t", "")
    scope("both empty: tenant is named first", "", "")
    scope("the key is checked too", "t", "m", "bad key!")
    scope("a missing key", "t", "m", "")
    # Whitespace and case: a key is taken exactly as given (no trimming, no folding).
    parse("a leading space is not trimmed", " order-42-x")
    parse("a trailing space is not trimmed", "order-42-x ")
    parse("a trailing newline is not trimmed", "order-42-x\n")
    parse("upper case is kept: keys are case-sensitive", "ORDER-42-CHARGE")
    parse("mixed case is kept", "Order-42-Charge")
    derive("a trailing space in the business id is data", "order-42 ", "charge")
    derive("case in the business id is data", "ORDER-42", "charge")
    scope("keys that differ in case are different keys ...", "case", "m", "ORDER-42-CHARGE")
    scope("... (the same key in lower case)", "case", "m", "order-42-charge")
    scope("tenants that differ in case are different tenants ...", "Acme", "m")
    scope("... (lower case)", "acme", "m")
    scope("spaces around a tenant are kept (and encoded)", " acme ", "m")
    # Which error first: the key, then the tenant, then the method.
    scope("a bad key and an empty tenant: the key is named", "", "m", "bad key!")
    scope("a missing key, an empty tenant and method: missing_key", "", "", "")
    scope("a good key, an empty tenant and a too long method: tenant", "", "m" * 1025)
    scope("a good key and tenant, a too long method: method", "t2", "m" * 1025)

    # Strings as UTF-16 code units (`<field>_utf16`): Python and JavaScript strings may
    # hold a lone surrogate, which UTF-8 (and a Rust `str`) cannot. Such a string is
    # INVALID_ARGUMENT naming its field; the Rust suite cannot build it and skips it.
    def utf16(text):
        raw = text.encode("utf-16-be", "surrogatepass")
        return [int.from_bytes(raw[i:i + 2], "big") for i in range(0, len(raw), 2)]

    def lone(comment, op, fields, error_field=None, **expect):
        case = {"op": op, "comment": comment}
        for name, value in fields.items():
            if isinstance(value, list):
                case[name + "_utf16"] = value
            else:
                case[name] = value
        if error_field is not None:
            case["error"] = {"kind": "invalid_argument", "field": error_field}
        case.update(expect)
        c.append(case)

    hi, lo = 0xD800, 0xDC00
    lone("a key with a lone high surrogate", "parse",
         {"key": utf16("order-42") + [hi]}, "idempotency_key")
    lone("a tenant with a lone high surrogate", "scope",
         {"tenant": utf16("acme") + [hi], "method": "m", "key": k}, "tenant")
    lone("a tenant that is a lone low surrogate", "scope",
         {"tenant": [lo], "method": "m", "key": k}, "tenant")
    lone("a method with a lone surrogate", "scope",
         {"tenant": "t", "method": [0xDFFF, 0x61], "key": k}, "method")
    lone("surrogates in the wrong order are two lone surrogates", "scope",
         {"tenant": [lo, hi], "method": "m", "key": k}, "tenant")
    lone("a lone surrogate in the tenant and a bad key: the key is named", "scope",
         {"tenant": [hi], "method": "m", "key": "bad key!"}, "idempotency_key")
    lone("a surrogate pair is one character: scoped as its UTF-8", "scope",
         {"tenant": utf16("\U0001F600x"), "method": "m", "key": k},
         scoped=scoped_key("\U0001F600x", "m", k))
    lone("a business id with a lone surrogate", "derive",
         {"business_id": [hi], "operation": "charge"}, "business_id")
    lone("an operation with a lone surrogate", "derive",
         {"business_id": "order-42", "operation": utf16("charge") + [lo]}, "operation")
    lone("a surrogate pair in a business id is one character", "derive",
         {"business_id": utf16("\U0001F389x"), "operation": "charge"},
         key=derive_key("\U0001F389x", "charge"))

    # Reading a scoped key back (Rust `ScopedKey::parse`; the bindings have none).
    def parse_scoped(comment, text):
        case = {"op": "parse_scoped", "comment": comment, "scoped": text}

        def bad(field="scoped_key"):
            case["error"] = {"kind": "invalid_argument", "field": field}
            c.append(case)

        if not text.startswith("v1:"):
            return bad()
        parts = text[3:].split(":", 2)
        if len(parts) != 3:
            return bad()
        decoded = []
        for part in parts[:2]:
            raw, i = bytearray(), 0
            while i < len(part):
                if part[i] == "%":
                    hx = part[i + 1:i + 3]
                    if len(hx) != 2 or not all(ch in "0123456789abcdefABCDEF" for ch in hx):
                        return bad()
                    raw.append(int(hx, 16))
                    i += 3
                else:
                    raw.extend(part[i].encode("utf-8"))
                    i += 1
            try:
                decoded.append(raw.decode("utf-8"))
            except UnicodeDecodeError:
                return bad()
        tenant, method, key = decoded[0], decoded[1], parts[2]
        if key == "":
            case["error"] = {"kind": "missing_key"}
            return c.append(case)
        if not key_valid(key):
            return bad("idempotency_key")
        for name, part in (("tenant", tenant), ("method", method)):
            if part == "" or len(part.encode("utf-8")) > 1024:
                return bad(name)
        if scoped_key(tenant, method, key) != text:
            return bad()
        case["valid"] = True
        c.append(case)

    parse_scoped("a scoped key reads back", scoped_key("acme", "CreateOrder", k))
    parse_scoped("escapes read back", scoped_key("a:b", "Cr\u00e9er {x}", k))
    parse_scoped("no v1: prefix", "acme:CreateOrder:" + k)
    parse_scoped("an upper-case prefix", "V1:acme:CreateOrder:" + k)
    parse_scoped("lower-case hex is not the canonical form", "v1:a%3ab:m:" + k)
    parse_scoped("an escape that is not needed", "v1:%61cme:m:" + k)
    parse_scoped("an escape that is cut short", "v1:acme%4:m:" + k)
    parse_scoped("escaped bytes that are not UTF-8", "v1:%FF:m:" + k)
    parse_scoped("no key part", "v1:acme:m")
    parse_scoped("an empty key", "v1:acme:m:")
    parse_scoped("a malformed key", "v1:acme:m:bad key!")
    parse_scoped("a ':' in the key part makes a malformed key", "v1:a:b:c:" + k)
    parse_scoped("an empty tenant", "v1::m:" + k)
    parse_scoped("a raw space in the tenant is not the canonical form", "v1:a b:m:" + k)

    # Injectivity: the triples of this file give pairwise different scoped keys.
    scoped = [x["scoped"] for x in c if x.get("op") == "scope" and "scoped" in x]
    assert len(scoped) == len(set(scoped))
    return c


# --------------------------------------------------------------------------------------
# 6. Fingerprints: canonical JSON (RFC 8785) and SHA-256
# --------------------------------------------------------------------------------------

def es_number(x):
    """ECMAScript Number::toString, as RFC 8785 §3.2.2.3 prescribes."""
    x = float(x)
    assert math.isfinite(x)
    if x == 0.0:
        return "0"  # also -0
    if x < 0:
        return "-" + es_number(-x)
    sign, digits, exp = decimal.Decimal(repr(x)).as_tuple()  # repr: shortest round-trip
    digits = list(digits)
    while len(digits) > 1 and digits[-1] == 0:
        digits.pop()
        exp += 1
    s = "".join(map(str, digits))
    k = len(s)
    n = exp + k  # x = 0.s * 10^n
    if k <= n <= 21:
        return s + "0" * (n - k)
    if 0 < n <= 21:
        return s[:n] + "." + s[n:]
    if -6 < n <= 0:
        return "0." + "0" * (-n) + s
    e = n - 1
    es = ("+" if e >= 0 else "-") + str(abs(e))
    return (s if k == 1 else s[0] + "." + s[1:]) + "e" + es


def es_string(s):
    out = ['"']
    short = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
             "\r": "\\r"}
    for ch in s:
        if ch in short:
            out.append(short[ch])
        elif ord(ch) < 0x20:
            out.append("\\u%04x" % ord(ch))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def jcs(v):
    """An independent RFC 8785 canonicalizer, to check the hand-written strings."""
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, (int, float)):
        return es_number(v)  # RFC 8785: every number is an IEEE double
    if isinstance(v, str):
        return es_string(v)
    if isinstance(v, list):
        return "[" + ",".join(jcs(x) for x in v) + "]"
    if isinstance(v, dict):
        items = sorted(v.items(), key=lambda kv: kv[0].encode("utf-16-be"))
        return "{" + ",".join(es_string(k) + ":" + jcs(x) for k, x in items) + "}"
    raise TypeError(type(v))


def fp(comment, value, canonical):
    assert jcs(value) == canonical, (comment, jcs(value), canonical)
    return {"comment": comment, "value": value, "canonical": canonical,
            "sha256": hashlib.sha256(canonical.encode("utf-8")).hexdigest()}


def fingerprint_cases():
    f = []
    f.append(fp("the doc example", {"sku": "A1", "qty": 2}, '{"qty":2,"sku":"A1"}'))
    f.append(fp("key order in the input never changes the digest",
                {"qty": 2, "sku": "A1"}, '{"qty":2,"sku":"A1"}'))
    f.append(fp("nested objects and arrays: keys sorted at every level, array order kept",
                {"b": {"z": 1, "a": [3, 2, 1]}, "a": {"y": None, "x": True}},
                '{"a":{"x":true,"y":null},"b":{"a":[3,2,1],"z":1}}'))
    f.append(fp("objects inside arrays",
                [{"b": 1, "a": 2}, {"d": [], "c": {}}], '[{"a":2,"b":1},{"c":{},"d":[]}]'))
    f.append(fp("deeply nested arrays", [[[[]]], [[1]]], "[[[[]]],[[1]]]"))
    f.append(fp("a typical request",
                {"order_id": "o-42", "amount": 12.5, "currency": "EUR",
                 "items": [{"sku": "A1", "qty": 1}, {"sku": "B2", "qty": 3}],
                 "note": None, "gift": False},
                '{"amount":12.5,"currency":"EUR","gift":false,'
                '"items":[{"qty":1,"sku":"A1"},{"qty":3,"sku":"B2"}],"note":null,'
                '"order_id":"o-42"}'))
    f.append(fp("empty object", {}, "{}"))
    f.append(fp("empty array", [], "[]"))
    f.append(fp("null", None, "null"))
    f.append(fp("true", True, "true"))
    f.append(fp("false", False, "false"))
    f.append(fp("empty string", "", '""'))
    f.append(fp("ASCII key order: upper case, '_', lower case",
                {"a": 1, "_": 2, "B": 3, "A": 4}, '{"A":4,"B":3,"_":2,"a":1}'))
    f.append(fp("keys sort as strings, not numbers", {"10": 1, "9": 2, "1": 3},
                '{"1":3,"10":1,"9":2}'))
    f.append(fp("a key that is a prefix of another sorts first", {"ab": 1, "a": 2},
                '{"a":2,"ab":1}'))
    f.append(fp("RFC 8785 §3.2.3 sorting example: by UTF-16 code units, not UTF-8 bytes",
                {"\u20ac": "Euro Sign", "\r": "Carriage Return",
                 "\ufb33": "Hebrew Letter Dalet With Dagesh", "1": "One",
                 "\U0001F600": "Emoji: Grinning Face", "\u0080": "Control",
                 "\u00f6": "Latin Small Letter O With Diaeresis"},
                '{"\\r":"Carriage Return","1":"One","\u0080":"Control",'
                '"\u00f6":"Latin Small Letter O With Diaeresis","\u20ac":"Euro Sign",'
                '"\U0001F600":"Emoji: Grinning Face","\ufb33":"Hebrew Letter Dalet With Dagesh"}'))
    f.append(fp("U+FFFF sorts after an astral character (UTF-16) though its UTF-8 is smaller",
                {"\uffff": 1, "\U0001F600": 2}, '{"\U0001F600":2,"\uffff":1}'))
    # Integers
    f.append(fp("integers", [0, 1, -1, 42, 1000000, -9007199254740991, 9007199254740991],
                "[0,1,-1,42,1000000,-9007199254740991,9007199254740991]"))
    f.append(fp("an integer beyond 2^53 is read as the nearest double (RFC 8785 §3.2.2.3)",
                9007199254740993, "9007199254740992"))
    f.append(fp("the largest 64-bit unsigned integer, as a double",
                18446744073709551615, "18446744073709552000"))
    f.append(fp("the smallest 64-bit signed integer, as a double",
                -9223372036854775808, "-9223372036854776000"))
    # Floats: ECMAScript shortest form (RFC 8785 Appendix B values among them)
    for value, text, why in [
        (1.0, "1", "1.0 is the integer 1"),
        (-1.0, "-1", "-1.0"),
        (100.0, "100", "100.0"),
        (-0.0, "0", "negative zero is 0"),
        (0.1, "0.1", "0.1"),
        (0.5, "0.5", "0.5"),
        (-1.5, "-1.5", "-1.5"),
        (123.456, "123.456", "123.456"),
        (1e20, "100000000000000000000", "1e20 is written out"),
        (1e21, "1e+21", "1e21 switches to exponent form"),
        (1e23, "1e+23", "1e23"),
        (9.999999999999997e22, "9.999999999999997e+22", "RFC 8785 Appendix B"),
        (1.0000000000000001e23, "1.0000000000000001e+23", "RFC 8785 Appendix B"),
        (999999999999999700000.0, "999999999999999700000", "RFC 8785 Appendix B"),
        (295147905179352830000.0, "295147905179352830000", "RFC 8785 Appendix B"),
        (9007199254740992.0, "9007199254740992", "2^53"),
        (1e-6, "0.000001", "1e-6 is written out"),
        (1e-7, "1e-7", "1e-7 switches to exponent form"),
        (9.999999999999997e-7, "9.999999999999997e-7", "RFC 8785 Appendix B"),
        (-0.0000033333333333333333, "-0.0000033333333333333333", "RFC 8785 Appendix B"),
        (333333333.3333332, "333333333.3333332", "RFC 8785 Appendix B"),
        (333333333.33333325, "333333333.33333325", "RFC 8785 Appendix B"),
        (333333333.33333343, "333333333.33333343", "RFC 8785 Appendix B"),
        (1424953923781206.2, "1424953923781206.2", "RFC 8785 Appendix B"),
        (5e-324, "5e-324", "smallest subnormal"),
        (-5e-324, "-5e-324", "smallest negative subnormal"),
        (1.7976931348623157e308, "1.7976931348623157e+308", "largest double"),
        (-1.7976931348623157e308, "-1.7976931348623157e+308", "most negative double"),
        (2.5e-5, "0.000025", "2.5e-5"),
        (1.5e300, "1.5e+300", "1.5e300"),
    ]:
        f.append(fp(f"number: {why}", value, text))
    f.append(fp("numbers inside an object", {"b": 1.0, "a": -0.0, "c": 1e21, "d": 0.1},
                '{"a":0,"b":1,"c":1e+21,"d":0.1}'))
    # Strings
    f.append(fp("short escapes", "\b\t\n\f\r", '"\\b\\t\\n\\f\\r"'))
    f.append(fp("other control characters as \\u00xx with lower-case hex",
                "\u0000\u0001\u000b\u001f", '"\\u0000\\u0001\\u000b\\u001f"'))
    f.append(fp("quote and backslash are escaped", 'say "hi" \\ bye', '"say \\"hi\\" \\\\ bye"'))
    f.append(fp("slash is not escaped", "a/b</c>", '"a/b</c>"'))
    f.append(fp("DEL and C1 controls are written as they are", "\u007f\u0080\u009f",
                '"\u007f\u0080\u009f"'))
    f.append(fp("non-ASCII is written as UTF-8, not escaped", "café €5 注文 😀",
                '"café €5 注文 😀"'))
    f.append(fp("U+2028 and U+2029 are written as they are", "a\u2028b\u2029c",
                '"a\u2028b\u2029c"'))
    f.append(fp("escapes in keys too", {"k\n": "v\t", "\"": "\\"},
                '{"\\"":"\\\\","k\\n":"v\\t"}'))

    def special(comment, canonical=None, **form):
        case = {"comment": comment}
        case.update(form)
        if canonical is None:
            case["error"] = {"kind": "invalid_argument", "field": "value"}
        else:
            case["canonical"] = canonical
            case["sha256"] = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
        f.append(case)

    # JSON text read by each language's own parser (`value_json`).
    special("duplicate names: the parsers keep the last member",
            '{"a":2}', value_json='{"a":1,"a":2}')
    special("duplicate names in a nested object, then sorted",
            '{"a":0,"b":{"x":[2]}}', value_json='{"b":{"x":1,"x":[2]},"a":0}')
    special("an integer beyond 2^64 is the nearest double",
            "18446744073709552000", value_json="18446744073709551616")
    special("an integer beyond 2^53 inside an object (read by the parser)",
            '{"id":9007199254740992}', value_json='{"id":9007199254740993}')
    special("an integer beyond the range of a double is refused",
            value_json="1" + "0" * 400)
    # NaN and infinities, which JSON cannot write (`value_special`).
    for name in ("NaN", "Infinity", "-Infinity"):
        for where in ("top", "array", "object"):
            special(f"{name} ({where}) has no JSON form: refused",
                    value_special={"float": name, "in": where})
    # Strings as UTF-16 code units (`value_utf16`, see keys.json).
    for where in ("top", "key"):
        special(f"a lone high surrogate in a string ({where}) is refused",
                value_utf16={"string_utf16": [0x61, 0xD800], "in": where})
        special(f"a lone low surrogate in a string ({where}) is refused",
                value_utf16={"string_utf16": [0xDC00], "in": where})
    special("a surrogate pair is one character, written as UTF-8",
            '"\U0001F600"', value_utf16={"string_utf16": [0xD83D, 0xDE00], "in": "top"})
    special("a surrogate pair in a key", '{"\U0001F600":0}',
            value_utf16={"string_utf16": [0xD83D, 0xDE00], "in": "key"})
    # Nesting (`nested`): `depth` arrays [[...]] or objects {"a":{"a":...}} inside each
    # other, the innermost empty. At most 100 levels (SPEC §6).
    for depth in (1, 2, 99, 100, 101, 128, 300):
        for kind in ("array", "object"):
            open_, close = ("[", "]") if kind == "array" else ('{"a":', "}")
            inner = "[]" if kind == "array" else "{}"
            canonical = open_ * (depth - 1) + inner + close * (depth - 1)
            special(f"{depth} nested {kind}s" + ("" if depth <= 100 else ": refused"),
                    canonical if depth <= 100 else None,
                    nested={"depth": depth, "kind": kind})
    return f


# --------------------------------------------------------------------------------------
# 7. Retry decisions (SPEC §4), for `Simulation`
# --------------------------------------------------------------------------------------

def simulate(case):
    """SPEC §4 on a simulated clock: attempt i gets script[i] (the last entry repeats)."""
    pol = case["policy"]
    seed = pol["seed"]
    if seed is None:
        assert pol["jitter"] == 0.0
        seed = 0
    min_attempt = pol["min_attempt_ms"]
    deadline = case["deadline_ms"]
    script = case["script"]
    now = 0
    attempt = 1
    delays = []
    while True:
        entry = script[min(attempt - 1, len(script) - 1)]
        now += entry["takes_ms"]
        if entry["outcome"] == "ok":
            result = "ok"
            break
        sd = entry["server_delay"]
        retryable, _ = spec_classify(entry["outcome"], case["safe"], case["rereads"],
                                     case["transient_internal"], sd)
        if not retryable:  # check 1
            result = "not_retryable"
            break
        if sd == "do_not_retry":  # a pushback that says "do not retry" is obeyed
            result = "server_said_no"
            break
        if not attempt < pol["max_attempts"]:  # check 2
            result = "attempts_exhausted"
            break
        # A server-provided delay overrides the computed backoff.
        delay = sd["after_ms"] if sd is not None else backoff_delay_ms(pol, attempt, seed)
        # Check 3: the next attempt, after the delay, must have min_attempt before the
        # deadline. Compared as instants: after an overrun (now > deadline) even a zero
        # delay and a zero min_attempt do not start another attempt.
        if deadline is not None and now + delay + min_attempt > deadline:
            result = "deadline"
            break
        delays.append(delay)
        now += delay
        attempt += 1
    return {"attempts": attempt, "delays_ms": delays, "result": result, "elapsed_ms": now}


def step(outcome, takes_ms=0, server_delay=None):
    if isinstance(server_delay, int):
        server_delay = {"after_ms": server_delay}
    return {"outcome": outcome, "takes_ms": takes_ms, "server_delay": server_delay}


def retry_pol(**over):
    p = policy(**over)
    p.setdefault("min_attempt_ms", 50)
    return p


def decision(comment, pol, script, safe=True, rereads=False, transient_internal=False,
             deadline_ms=None, expect_result=None):
    case = {"comment": comment, "policy": pol, "safe": safe, "rereads": rereads,
            "transient_internal": transient_internal, "deadline_ms": deadline_ms,
            "script": script}
    case["expect"] = simulate(case)
    if expect_result is not None:  # what the scenario is meant to show
        assert case["expect"]["result"] == expect_result, (comment, case["expect"])
    return case


def retry_decision_cases():
    U, RE, OK = "UNAVAILABLE", "RESOURCE_EXHAUSTED", "ok"
    nj = retry_pol(jitter=0.0)
    d = []
    d.append(decision("success at the first attempt", nj, [step(OK, 5)], expect_result="ok"))
    d.append(decision("one retry: UNAVAILABLE, then success",
                      nj, [step(U, 10), step(OK, 5)], expect_result="ok"))
    d.append(decision("UNAVAILABLE on a call that is not safe is not retried",
                      nj, [step(U, 10), step(OK)], safe=False, expect_result="not_retryable"))
    d.append(decision("INVALID_ARGUMENT is never retried", nj,
                      [step("INVALID_ARGUMENT", 3), step(OK)], expect_result="not_retryable"))
    d.append(decision("DATA_LOSS is never retried", nj, [step("DATA_LOSS", 3), step(OK)],
                      expect_result="not_retryable"))
    d.append(decision("a retryable error followed by a permanent one",
                      nj, [step(U, 10), step("NOT_FOUND", 10), step(OK)],
                      expect_result="not_retryable"))
    d.append(decision("3 attempts, all UNAVAILABLE, no jitter: delays 20 and 40",
                      nj, [step(U, 10), step(U, 10), step(U, 10)],
                      expect_result="attempts_exhausted"))
    d.append(decision("SPEC defaults seeded 42: attempts exhausted after 3",
                      retry_pol(seed=42), [step(U, 7)], expect_result="attempts_exhausted"))
    d.append(decision("the last script entry repeats: 6 attempts of UNAVAILABLE",
                      retry_pol(max_attempts=6, seed=9), [step(U, 1)],
                      expect_result="attempts_exhausted"))
    d.append(decision("max_attempts 1: no retry at all", retry_pol(max_attempts=1, seed=1),
                      [step(U, 10), step(OK)], expect_result="attempts_exhausted"))
    d.append(decision("success at the last allowed attempt", retry_pol(seed=5),
                      [step(U, 10), step(U, 10), step(OK, 10)], expect_result="ok"))
    d.append(decision("RESOURCE_EXHAUSTED is retried even when not safe",
                      nj, [step(RE, 5), step(OK, 5)], safe=False, expect_result="ok"))
    d.append(decision("the server's delay (Retry-After) overrides the backoff",
                      retry_pol(seed=3), [step(RE, 5, 300), step(OK, 5)], safe=False,
                      expect_result="ok"))
    d.append(decision("a server delay on UNAVAILABLE overrides the backoff too",
                      retry_pol(seed=3), [step(U, 5, 750), step(OK, 5)], expect_result="ok"))
    d.append(decision("a server delay of 0: retry at once", nj, [step(RE, 5, 0), step(OK, 5)],
                      expect_result="ok"))
    d.append(decision("backoff after a server delay uses the attempt number: 500, then 40",
                      retry_pol(jitter=0.0, max_attempts=4),
                      [step(RE, 1, 500), step(U, 1), step(U, 1), step(OK, 1)],
                      expect_result="ok"))
    d.append(decision("a server delay may exceed max_delay", nj,
                      [step(RE, 5, 5000), step(OK, 5)], expect_result="ok"))
    d.append(decision("the server says do not retry (negative pushback)",
                      retry_pol(seed=1), [step(RE, 5, "do_not_retry"), step(OK)],
                      expect_result="server_said_no"))
    d.append(decision("do-not-retry on a later attempt", nj,
                      [step(U, 5), step(U, 5, "do_not_retry"), step(OK)],
                      expect_result="server_said_no"))
    d.append(decision("a permanent error is not_retryable whatever the pushback says", nj,
                      [step("PERMISSION_DENIED", 5, "do_not_retry")],
                      expect_result="not_retryable"))
    d.append(decision("deadline: delay + min_attempt fits exactly, then no longer",
                      nj, [step(U, 30), step(U, 30), step(OK, 1)], deadline_ms=100,
                      expect_result="deadline"))
    d.append(decision("deadline: the delay (20) fits in the 69 ms left, "
                      "but delay + min_attempt (70) does not",
                      nj, [step(U, 30), step(OK, 1)], deadline_ms=99, expect_result="deadline"))
    d.append(decision("a server delay longer than the remaining budget ends at once",
                      nj, [step(RE, 10, 5000), step(OK, 1)], deadline_ms=1000,
                      expect_result="deadline"))
    d.append(decision("a server delay that leaves exactly min_attempt is accepted",
                      nj, [step(RE, 10, 940), step(OK, 1)], deadline_ms=1000,
                      expect_result="ok"))
    d.append(decision("an attempt that overruns the deadline leaves no time: deadline",
                      nj, [step(U, 300), step(OK, 1)], deadline_ms=200,
                      expect_result="deadline"))
    d.append(decision("min_attempt 0: a retry may start right at the deadline",
                      retry_pol(jitter=0.0, min_attempt_ms=0), [step(U, 80), step(OK, 0)],
                      deadline_ms=100, expect_result="ok"))
    d.append(decision("a larger min_attempt stops earlier",
                      retry_pol(jitter=0.0, min_attempt_ms=500), [step(U, 10), step(OK, 0)],
                      deadline_ms=500, expect_result="deadline"))
    d.append(decision("seeded jitter under a deadline: 5 attempts allowed, the deadline ends it",
                      retry_pol(max_attempts=5, seed=42, base_delay_ms=100), [step(U, 40)],
                      deadline_ms=600, expect_result="deadline"))
    d.append(decision("the doc example of Simulation: seed 42, 5 attempts, 200 ms deadline",
                      retry_pol(max_attempts=5, seed=42), [step(U, 30)], deadline_ms=200,
                      expect_result="deadline"))
    d.append(decision("a generous deadline does not get in the way",
                      retry_pol(seed=42), [step(U, 30), step(U, 30), step(OK, 30)],
                      deadline_ms=10000, expect_result="ok"))
    d.append(decision("DEADLINE_EXCEEDED of one attempt on a safe call is retried",
                      nj, [step("DEADLINE_EXCEEDED", 100), step(OK, 10)], deadline_ms=1000,
                      expect_result="ok"))
    d.append(decision("DEADLINE_EXCEEDED on a call that is not safe is not retried",
                      nj, [step("DEADLINE_EXCEEDED", 100), step(OK, 10)], safe=False,
                      expect_result="not_retryable"))
    d.append(decision("ABORTED is retried when each attempt re-reads",
                      nj, [step("ABORTED", 5), step(OK, 5)], safe=False, rereads=True,
                      expect_result="ok"))
    d.append(decision("ABORTED is not retried when the write would be resent unchanged",
                      nj, [step("ABORTED", 5), step(OK, 5)], expect_result="not_retryable"))
    d.append(decision("in progress (ABORTED with a server delay) on a keyed call is resent "
                      "after the delay", nj,
                      [step("ABORTED", 5, 300), step("ABORTED", 5, 300), step(OK, 5)],
                      expect_result="ok"))
    d.append(decision("in progress on a call that is not safe is not resent",
                      nj, [step("ABORTED", 5, 300), step(OK, 5)], safe=False,
                      expect_result="not_retryable"))
    d.append(decision("in progress on a keyed call: attempts run out",
                      nj, [step("ABORTED", 5, 100)], expect_result="attempts_exhausted"))
    d.append(decision("in progress on a keyed call: the delay does not fit the deadline",
                      nj, [step("ABORTED", 5, 2000)], deadline_ms=1000,
                      expect_result="deadline"))
    d.append(decision("INTERNAL declared transient on a safe call is retried",
                      nj, [step("INTERNAL", 5), step("UNKNOWN", 5), step(OK, 5)],
                      transient_internal=True, expect_result="ok"))
    d.append(decision("INTERNAL declared transient on a call that is not safe is not retried",
                      nj, [step("INTERNAL", 5), step(OK, 5)], safe=False,
                      transient_internal=True, expect_result="not_retryable"))
    d.append(decision("INTERNAL without the opt-in is not retried",
                      nj, [step("INTERNAL", 5), step(OK, 5)], expect_result="not_retryable"))
    d.append(decision("long capped delays without a deadline",
                      retry_pol(max_attempts=5, base_delay_ms=400, max_delay_ms=1000,
                                seed=2024), [step(U, 100)],
                      expect_result="attempts_exhausted"))
    # Where two stop reasons apply at once, the order of SPEC §4 decides.
    d.append(decision("an overrun attempt, then a server delay of 0 and min_attempt 0: "
                      "no attempt starts after the deadline",
                      retry_pol(jitter=0.0, min_attempt_ms=0), [step(U, 300, 0), step(OK, 1)],
                      deadline_ms=200, expect_result="deadline"))
    d.append(decision("an overrun attempt with base delay 0 and min_attempt 0: deadline",
                      retry_pol(base_delay_ms=0, jitter=0.0, min_attempt_ms=0),
                      [step(U, 201), step(OK, 1)], deadline_ms=200, expect_result="deadline"))
    d.append(decision("an attempt that ends exactly at the deadline, zero delay, min_attempt 0: "
                      "the next attempt may start at the deadline",
                      retry_pol(base_delay_ms=0, jitter=0.0, min_attempt_ms=0),
                      [step(U, 200), step(OK, 0)], deadline_ms=200, expect_result="ok"))
    d.append(decision("do-not-retry on the last allowed attempt: server_said_no, "
                      "not attempts_exhausted", retry_pol(jitter=0.0, max_attempts=2),
                      [step(U, 5), step(U, 5, "do_not_retry")], expect_result="server_said_no"))
    d.append(decision("do-not-retry with max_attempts 1: server_said_no",
                      retry_pol(jitter=0.0, max_attempts=1), [step(RE, 5, "do_not_retry")],
                      expect_result="server_said_no"))
    d.append(decision("the last allowed attempt also overruns the deadline: attempts_exhausted "
                      "(checked before the deadline)", retry_pol(jitter=0.0, max_attempts=2),
                      [step(U, 10), step(U, 500)], deadline_ms=100,
                      expect_result="attempts_exhausted"))
    d.append(decision("not retryable and past the deadline: not_retryable",
                      nj, [step("NOT_FOUND", 500)], deadline_ms=100,
                      expect_result="not_retryable"))
    d.append(decision("a success that ends after the deadline is a success",
                      nj, [step(U, 10), step(OK, 500)], deadline_ms=100, expect_result="ok"))
    d.append(decision("a first attempt that succeeds after the deadline is a success",
                      nj, [step(OK, 500)], deadline_ms=100, expect_result="ok"))
    d.append(decision("a mixed timeline: backoff, server delay, backoff, success",
                      retry_pol(max_attempts=5, seed=77),
                      [step(U, 12), step(RE, 8, 250), step(U, 15), step(OK, 20)],
                      deadline_ms=5000, expect_result="ok"))
    return d



# --------------------------------------------------------------------------------------
# 7b. The retry budget (SPEC §4 "Retry budget"), on a manual clock
# --------------------------------------------------------------------------------------

BUDGET_SLOTS = 10


class BudgetModel:
    """SPEC §4's budget: `window` kept as 10 slots of window/10; a retry is allowed while
    retries + 1 <= ratio x requests + min_per_sec x window (seconds), both counted over the
    slots from floor(t/slot) - 9 to floor(t/slot)."""

    def __init__(self, ratio, window_ms, min_per_sec):
        assert window_ms % BUDGET_SLOTS == 0
        self.ratio, self.window_ms, self.min_per_sec = ratio, window_ms, min_per_sec
        self.slot_ms = window_ms // BUDGET_SLOTS
        self.slots = [[0, 0, 0] for _ in range(BUDGET_SLOTS)]  # tick, requests, retries

    def _current(self, now_ms):
        tick = now_ms // self.slot_ms
        slot = self.slots[tick % BUDGET_SLOTS]
        if slot[0] != tick:
            slot[:] = [tick, 0, 0]
        return tick, slot

    def _totals(self, tick):
        oldest = max(tick - (BUDGET_SLOTS - 1), 0)
        live = [s for s in self.slots if oldest <= s[0] <= tick]
        return sum(s[1] for s in live), sum(s[2] for s in live)

    def allowed(self, requests):
        return self.ratio * requests + self.min_per_sec * (self.window_ms / 1000)

    def requests(self, now_ms, n):
        _, slot = self._current(now_ms)
        slot[1] += n

    def withdraw(self, now_ms):
        tick, slot = self._current(now_ms)
        requests, retries = self._totals(tick)
        if retries + 1 <= self.allowed(requests):
            slot[2] += 1
            return True
        return False

    def snapshot(self, now_ms):
        tick, _ = self._current(now_ms)
        requests, retries = self._totals(tick)
        return {"requests": requests, "retries": retries, "allowed": self.allowed(requests)}


def budget_case(comment, ratio, window_ms, min_per_sec, script):
    """`script`: (at_ms, "requests", n) | (at_ms, "withdraw", n) | (at_ms, "snapshot")."""
    model = BudgetModel(ratio, window_ms, min_per_sec)
    steps = []
    last = 0
    for at, op, *n in script:
        assert at >= last  # the clock never goes back
        last = at
        if op == "requests":
            model.requests(at, n[0])
            steps.append({"at_ms": at, "requests": n[0]})
        elif op == "withdraw":
            results = [model.withdraw(at) for _ in range(n[0])]
            granted = results.count(True)
            assert results == [True] * granted + [False] * (n[0] - granted)
            steps.append({"at_ms": at, "withdraw": n[0], "granted": granted})
        else:
            steps.append({"at_ms": at, "snapshot": model.snapshot(at)})
    return {"comment": comment,
            "budget": {"ratio": ratio, "window_ms": window_ms, "min_per_sec": min_per_sec},
            "steps": steps}


def budget_cases():
    b = []
    b.append(budget_case("the doc example: 10 % of 20 requests is 2 retries", 0.1, 10_000, 0,
                         [(0, "requests", 20), (0, "withdraw", 3), (0, "snapshot")]))
    b.append(budget_case("the floor alone: 10 per second over 10 s allows 100 retries", 0.1,
                         10_000, 10, [(0, "snapshot"), (0, "withdraw", 101), (0, "snapshot")]))
    b.append(budget_case("the defaults: 0.1 x 50 requests + 10 x 10 s = 105", 0.1, 10_000, 10,
                         [(0, "requests", 50), (100, "withdraw", 106), (200, "snapshot")]))
    b.append(budget_case("a fraction: 0.1 x 15 = 1.5 allows one retry (retries + 1 <= 1.5)",
                         0.1, 10_000, 0, [(0, "requests", 15), (0, "withdraw", 2),
                                          (0, "snapshot")]))
    b.append(budget_case("ratio 0 with a floor of 1 per second over 2 s: 2 retries", 0.0,
                         2_000, 1, [(0, "requests", 1000), (0, "withdraw", 3)]))
    b.append(budget_case("no ratio, no floor: never a retry", 0.0, 10_000, 0,
                         [(0, "requests", 100), (0, "withdraw", 1), (0, "snapshot")]))
    b.append(budget_case("the window slides in steps of window/10: counts leave it whole",
                         0.5, 1_000, 0,
                         [(0, "requests", 10), (0, "withdraw", 6), (950, "snapshot"),
                          (999, "snapshot"), (1000, "snapshot"), (1000, "withdraw", 1)]))
    b.append(budget_case("requests from two slots: the older leaves first", 0.5, 1_000, 0,
                         [(0, "requests", 10), (500, "requests", 10), (600, "snapshot"),
                          (1000, "snapshot"), (1000, "withdraw", 6), (1499, "snapshot"),
                          (1500, "snapshot"), (1500, "withdraw", 1)]))
    b.append(budget_case("retries withdrawn in a later slot outlive the requests that "
                         "allowed them", 1.0, 1_000, 0,
                         [(0, "requests", 4), (900, "withdraw", 4), (1000, "snapshot"),
                          (1000, "requests", 4), (1000, "withdraw", 1), (1900, "snapshot"),
                          (1900, "withdraw", 1)]))
    b.append(budget_case("a long quiet gap empties the window", 0.2, 10_000, 0,
                         [(0, "requests", 100), (0, "withdraw", 5), (3_600_000, "snapshot"),
                          (3_600_000, "withdraw", 1)]))
    b.append(budget_case("the smallest window, 10 ms: 1 ms slots", 1.0, 10, 0,
                         [(0, "requests", 3), (9, "withdraw", 4), (10, "snapshot"),
                          (10, "withdraw", 1)]))
    for comment, ratio, window_ms, field in [
        ("a negative ratio is refused", -0.1, 10_000, "ratio"),
        ("a window shorter than 10 ms is refused", 0.1, 9, "window"),
        ("a window of 0 is refused", 0.1, 0, "window"),
    ]:
        b.append({"comment": comment,
                  "budget": {"ratio": ratio, "window_ms": window_ms, "min_per_sec": 0},
                  "error": {"kind": "invalid_argument", "field": field}})
    return b


# --------------------------------------------------------------------------------------
# 8. The server contract (SPEC §8; oncely::http)
# --------------------------------------------------------------------------------------

DEFAULT_METHODS = ["POST", "PATCH"]
DEFAULT_STORED = ["content-type", "content-encoding", "location", "etag"]
NEVER_STORED = ["connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
                "content-length", "idempotent-replayed"]
PROBLEM = "urn:oncely:problem:"


def http_storable(status):
    return 200 <= status <= 299 or (400 <= status <= 499 and status not in (408, 409, 425, 429))


def http_has_content(method, status):
    """RFC 9110 §6.4.1: no content in a response to HEAD, nor in a 1xx, 204 or 304."""
    return method != "HEAD" and not (100 <= status <= 199 or status in (204, 304))


def http_declared_length(value):
    """The length a Content-Length declares, as text: decimal digits with spaces and tabs
    around them ("max" from 2^64 - 1 on), else "none"."""
    digits = value.strip(" \t")
    if not digits or not all(ch in "0123456789" for ch in digits):
        return "none"
    return str(int(digits)) if int(digits) < 2**64 - 1 else "max"


def http_declares_too_large(cap, value):
    """A Content-Length of decimal digits (spaces and tabs around them) over `cap`."""
    length = http_declared_length(value)
    return length != "none" and (length == "max" or int(length) > cap)


def http_stores_header(stored, name):
    n = name.lower()
    return n not in NEVER_STORED and n in [h.lower() for h in (stored or DEFAULT_STORED)]


def http_shares_header(stored, name):
    n = name.lower()
    if n == "set-cookie":
        return http_stores_header(stored, name)
    return n not in NEVER_STORED


def http_is_json(ct):
    essence = ct.split(";")[0].strip().lower()
    if "/" not in essence:
        return False
    top, sub = essence.split("/", 1)
    return top != "" and (essence == "application/json" or sub.endswith("+json"))


def http_fingerprint(method, target, content_type, body):
    kind, data = b"b", body
    if content_type is not None and http_is_json(content_type):
        try:
            data = jcs(json.loads(body.decode("utf-8"))).encode("utf-8")
            kind = b"j"
        except (ValueError, UnicodeDecodeError):
            pass
    buf = b"oncely-http-v1"
    for part in (method.encode(), target.encode()):
        buf += struct.pack(">Q", len(part)) + part
    buf += kind + struct.pack(">Q", len(data)) + data
    return hashlib.sha256(buf).hexdigest()


def http_record(status, headers, body, trailers):
    out = b"OHR1" + struct.pack(">H", status)
    for lst in (headers, trailers):
        out += struct.pack(">I", len(lst))
        for n, v in lst:
            nb, vb = n.encode(), v.encode()
            out += struct.pack(">I", len(nb)) + nb + struct.pack(">I", len(vb)) + vb
    return out + struct.pack(">I", len(body)) + body


def req(method="POST", path="/orders", key="order-0001", body='{"sku":"A1","qty":1}',
        content_type="application/json", status=None, nbytes=None, delay_ms=None,
        tenant=None, extra=None):
    r = {"method": method, "path": path, "headers": {}, "body": body}
    if key is not None:
        r["headers"]["idempotency-key"] = key
    if content_type is not None:
        r["headers"]["content-type"] = content_type
    if tenant is not None:
        r["headers"]["x-tenant"] = tenant
    respond = {}
    if status is not None:
        respond["status"] = status
    if nbytes is not None:
        respond["bytes"] = nbytes
    if delay_ms is not None:
        respond["delay_ms"] = delay_ms
    if respond:
        r["respond"] = respond
    if extra:
        r["headers"].update(extra)
    return r


def ran(call, status=201, **more):
    """A response the handler made for this request: call number `call`, not a replay."""
    e = {"status": status, "call": call, "replayed": False}
    e.update(more)
    return e


def replay(call, status=201, **more):
    """A replay of the response the handler made in call `call`."""
    e = {"status": status, "call": call, "replayed": True,
         "headers": {"etag": f'"call-{call}"', "x-call": None, "set-cookie": None}}
    e.update(more)
    return e


def refused(status, slug, **more):
    e = {"status": status, "problem": PROBLEM + slug, "replayed": False}
    e.update(more)
    return e


def seq(comment, steps, handler_calls, **config):
    return {"op": "sequence", "comment": comment, "config": config, "steps": steps,
            "handler_calls": handler_calls}


def http_server_cases():
    c = []
    # --- unit-level decisions ---
    for methods, method in [(None, "POST"), (None, "PATCH"), (None, "PUT"), (None, "GET"),
                            (None, "DELETE"), (None, "post"), (["PUT", "DELETE"], "PUT"),
                            (["PUT", "DELETE"], "POST")]:
        covered = method in (methods or DEFAULT_METHODS)
        c.append({"op": "covers", "methods": methods, "method": method, "covered": covered,
                  "comment": "covered methods (case-sensitive)"})
    for comment, method, values, required, expect in [
        ("a valid key", "POST", ["order-0001"], True, {"dedup": "order-0001"}),
        ("a UUID key", "PATCH", ["0b0e9c3e-4f0b-4c55-9d1a-2b1f2e3c4d5e"], True,
         {"dedup": "0b0e9c3e-4f0b-4c55-9d1a-2b1f2e3c4d5e"}),
        ("not covered: the key is not even read", "GET", ["bad key!"], True, {"pass_through": True}),
        ("missing, required", "POST", [], True, {"problem": {"status": 400, "type": PROBLEM + "missing-key", "code": "INVALID_ARGUMENT"}}),
        ("empty counts as missing", "POST", [""], True, {"problem": {"status": 400, "type": PROBLEM + "missing-key", "code": "INVALID_ARGUMENT"}}),
        ("missing, not required: pass through", "POST", [], False, {"pass_through": True}),
        ("empty, not required: pass through", "POST", [""], False, {"pass_through": True}),
        ("invalid character", "POST", ["bad key!"], True, {"problem": {"status": 400, "type": PROBLEM + "invalid-key", "code": "INVALID_ARGUMENT"}}),
        ("invalid even when not required", "POST", ["bad key!"], False, {"problem": {"status": 400, "type": PROBLEM + "invalid-key", "code": "INVALID_ARGUMENT"}}),
        ("too short", "POST", ["short"], True, {"problem": {"status": 400, "type": PROBLEM + "invalid-key", "code": "INVALID_ARGUMENT"}}),
        ("too long", "POST", ["k" * 65], True, {"problem": {"status": 400, "type": PROBLEM + "invalid-key", "code": "INVALID_ARGUMENT"}}),
        ("sent twice", "POST", ["order-0001", "order-0001"], True, {"problem": {"status": 400, "type": PROBLEM + "invalid-key", "code": "INVALID_ARGUMENT"}}),
        ("not ASCII", "POST", ["ordér-0001"], True, {"problem": {"status": 400, "type": PROBLEM + "invalid-key", "code": "INVALID_ARGUMENT"}}),
    ]:
        c.append({"op": "read_key", "comment": comment, "method": method, "values": values,
                  "required": required, "expect": expect})
    for tenant, method, route, key in [("default", "POST", "/orders", "order-0001"),
                                       ("acme", "PATCH", "/orders/{id}", "order-0001"),
                                       ("a:b", "POST", "/x y", "order-0001"),
                                       ("acme", "POST", "/pkg.Orders/Create", "order-0001")]:
        c.append({"op": "scope", "tenant": tenant, "method": method, "route": route, "key": key,
                  "scoped": scoped_key(tenant, f"{method} {route}", key)})
    for comment, method, target, ct, body in [
        ("JSON body", "POST", "/orders", "application/json", '{"sku":"A1","qty":1}'),
        ("the same JSON, other key order and whitespace", "POST", "/orders", "application/json", '{ "qty": 1.0, "sku": "A1" }'),
        ("+json and parameters", "POST", "/orders", "application/merge-patch+json; charset=utf-8", '{"qty":1,"sku":"A1"}'),
        ("upper-case content type", "POST", "/orders", "Application/JSON", '{"qty":1,"sku":"A1"}'),
        ("not JSON: raw bytes", "POST", "/orders", "text/plain", '{"sku":"A1","qty":1}'),
        ("no content type: raw bytes", "POST", "/orders", None, '{"sku":"A1","qty":1}'),
        ("JSON type but broken JSON: raw bytes", "POST", "/orders", "application/json", '{"sku":'),
        ("empty body", "POST", "/orders", "application/json", ""),
        ("the query is part of the target", "POST", "/orders?dry=1", "application/json", '{"qty":1,"sku":"A1"}'),
        ("another method", "PATCH", "/orders", "application/json", '{"qty":1,"sku":"A1"}'),
        ("another path", "POST", "/orders/2", "application/json", '{"qty":1,"sku":"A1"}'),
        ("not-quite JSON type", "POST", "/orders", "application/jsonp", '{"qty":1,"sku":"A1"}'),
    ]:
        c.append({"op": "fingerprint", "comment": comment, "method": method, "target": target,
                  "content_type": ct, "body": body,
                  "fingerprint": http_fingerprint(method, target, ct, body.encode("utf-8"))})
    c.append({"op": "fingerprint", "comment": "binary body", "method": "POST", "target": "/upload",
              "content_type": "application/octet-stream", "body_hex": "00ff10c3",
              "fingerprint": http_fingerprint("POST", "/upload", "application/octet-stream", bytes.fromhex("00ff10c3"))})
    for status in [100, 199, 200, 201, 204, 299, 301, 303, 304, 400, 401, 403, 404, 408, 409,
                   410, 422, 425, 429, 499, 500, 502, 503, 504, 599]:
        c.append({"op": "status", "status": status, "storable": http_storable(status)})
    for stored, name in [(None, "content-type"), (None, "Content-Type"), (None, "ETag"),
                         (None, "location"), (None, "content-encoding"), (None, "set-cookie"),
                         (None, "x-request-id"), (None, "content-length"), (None, "transfer-encoding"),
                         (None, "connection"), (None, "idempotent-replayed"),
                         (["content-type", "Set-Cookie", "x-request-id"], "set-cookie"),
                         (["content-type", "Set-Cookie", "x-request-id"], "x-request-id"),
                         (["content-type", "Set-Cookie", "x-request-id"], "etag"),
                         (["connection", "content-length", "upgrade"], "connection"),
                         (["connection", "content-length", "upgrade"], "content-length"),
                         (None, "retry-after"), (None, "WWW-Authenticate")]:
        c.append({"op": "header", "stored_headers": stored, "name": name,
                  "stored": http_stores_header(stored, name),
                  "shared": http_shares_header(stored, name)})
    for comment, status, headers, body, trailers in [
        ("a JSON 201", 201, [["content-type", "application/json"], ["location", "/orders/1"]], b'{"id":1}', []),
        ("empty", 204, [], b"", []),
        ("gRPC: trailers kept", 200, [["content-type", "application/grpc"]], b"\x00\x00\x00\x00\x02\x08\x01",
         [["grpc-status", "0"], ["grpc-message", ""]]),
    ]:
        c.append({"op": "record", "comment": comment,
                  "response": {"status": status, "headers": headers, "body_hex": body.hex(),
                               "trailers": trailers},
                  "hex": http_record(status, headers, body, trailers).hex()})
    good = http_record(201, [["etag", "x"]], b"{}", [])
    for comment, raw in [("another tag", b"OHR2" + good[4:]), ("truncated", good[:-1]),
                         ("trailing bytes", good + b"\x00"), ("empty", b""),
                         ("a JSON value, not a record", b'{"status":201}')]:
        c.append({"op": "record_decode", "comment": comment, "hex": raw.hex(),
                  "error": "UNAVAILABLE"})
    for error, status, slug, code, retry_after in [
        ({"kind": "missing_key"}, 400, "missing-key", "INVALID_ARGUMENT", None),
        ({"kind": "invalid_argument", "field": "idempotency_key"}, 400, "invalid-key", "INVALID_ARGUMENT", None),
        ({"kind": "fingerprint_mismatch"}, 422, "key-reused", "FAILED_PRECONDITION", None),
        ({"kind": "in_progress", "retry_after_ms": 1000}, 409, "in-progress", "ABORTED", "1"),
        ({"kind": "in_progress", "retry_after_ms": 1500}, 409, "in-progress", "ABORTED", "2"),
        ({"kind": "in_progress", "retry_after_ms": 0}, 409, "in-progress", "ABORTED", "1"),
        ({"kind": "lease_lost"}, 409, "lease-lost", "ABORTED", None),
        ({"kind": "capacity"}, 503, "capacity", "RESOURCE_EXHAUSTED", "1"),
        ({"kind": "unavailable"}, 503, "unavailable", "UNAVAILABLE", "1"),
        ({"kind": "leader_panicked"}, 500, "internal", "INTERNAL", None),
        # The server's own faults are INTERNAL whatever the error's code: a final gRPC
        # status would be stored by an adapter around the one that refused.
        ({"kind": "reentrant"}, 500, "internal", "INTERNAL", None),
        ({"kind": "result_not_stored"}, 500, "internal", "INTERNAL", None),
    ]:
        headers = {"content-type": "application/problem+json"}
        if retry_after is not None:
            headers["retry-after"] = retry_after
        c.append({"op": "problem", "error": error, "status": status, "type": PROBLEM + slug,
                  "code": code, "headers": headers})

    # gRPC: calls are POSTs; covered when POST is, and listed when a list is set.
    for methods, grpc_methods, full, covered in [
            (None, None, "/shop.Orders/Create", True),
            (["PUT"], None, "/shop.Orders/Create", False),
            (None, ["/shop.Orders/Create"], "/shop.Orders/Create", True),
            (None, ["/shop.Orders/Create"], "/shop.Orders/Get", False)]:
        c.append({"op": "covers_grpc", "methods": methods, "grpc_methods": grpc_methods,
                  "full_method": full, "covered": covered})
    grpc_stored = {0, 3, 5, 6, 7, 9, 11, 16}
    for value in [str(n) for n in range(17)] + ["17", "", "abc", "-1", " 0", "00"]:
        ok = value.isdigit() and value.isascii() and int(value) in grpc_stored
        c.append({"op": "grpc_status", "value": value, "storable": ok})
    for error, status, pushback in [
        ({"kind": "missing_key"}, "3", None),
        ({"kind": "invalid_argument", "field": "idempotency_key"}, "3", None),
        ({"kind": "fingerprint_mismatch"}, "9", None),
        ({"kind": "in_progress", "retry_after_ms": 1500}, "10", "1500"),
        ({"kind": "unavailable"}, "14", "1000"),
        ({"kind": "leader_panicked"}, "13", None),
        ({"kind": "reentrant"}, "13", None),
        ({"kind": "result_not_stored"}, "13", None),
    ]:
        c.append({"op": "grpc_problem", "error": error, "grpc_status": status,
                  "grpc_retry_pushback_ms": pushback})
    for ct, grpc in [("application/grpc", True), ("application/grpc+proto", True),
                     ("Application/GRPC; charset=x", True), ("application/grpc-web", False),
                     ("application/json", False)]:
        c.append({"op": "is_grpc", "content_type": ct, "grpc": grpc})
    for ct, streams in [("text/event-stream", True), ("Text/Event-Stream; charset=utf-8", True),
                        ("text/plain", False), ("application/json", False),
                        ("text/event-streams", False)]:
        c.append({"op": "is_event_stream", "content_type": ct, "event_stream": streams})

    # What a response carries (RFC 9110 §6.4.1): its record keeps no body when it has none.
    for method, status in [("POST", 200), ("POST", 201), ("HEAD", 200), ("HEAD", 404),
                           ("POST", 100), ("POST", 199), ("POST", 204), ("POST", 205),
                           ("PATCH", 304), ("GET", 302), ("head", 200)]:
        c.append({"op": "content", "method": method, "status": status,
                  "has_content": http_has_content(method, status)})
    # A declared Content-Length over the request cap: refused before the body is read.
    for cap, value in [(1024, "1024"), (1024, "1025"), (1024, "0"), (0, "0"), (0, "1"),
                       (1024, " 2048\t"), (1024, "0002048"), (1024, "99999999999999999999999"),
                       (1024, ""), (1024, "  "), (1024, "0x800"), (1024, "2e9"), (1024, "-5"),
                       (1024, "+2048"), (1024, "2048, 2048"), (1024, "1 0 2 5"),
                       (1 << 20, str(1 << 20)), (1 << 20, str((1 << 20) + 1))]:
        c.append({"op": "declared_length", "request_cap": cap, "value": value,
                  "length": http_declared_length(value),
                  "too_large": http_declares_too_large(cap, value)})

    # --- request sequences, run against a real server by every adapter ---
    # The test server (see README.md): POST|PATCH|PUT|GET /orders, /orders/{id} and
    # /payments; the handler counts its calls and answers per the request's `respond`.
    c.append(seq("a retry with the same key is replayed, handler once; only the stored headers come back", [
        {"request": req(), "expect": ran(1, headers={"etag": '"call-1"', "x-call": "1", "set-cookie": "call=1"})},
        {"request": req(), "expect": replay(1)},
        {"request": req(), "expect": replay(1)}], 1))
    c.append(seq("missing key on a covered request: 400 problem, handler not called", [
        {"request": req(key=None), "expect": refused(400, "missing-key")}], 0))
    c.append(seq("missing key, not required: passed through every time", [
        {"request": req(key=None), "expect": ran(1)},
        {"request": req(key=None), "expect": ran(2)}], 2, required=False))
    c.append(seq("invalid key: 400 problem", [
        {"request": req(key="bad key!"), "expect": refused(400, "invalid-key")},
        {"request": req(key="short"), "expect": refused(400, "invalid-key")}], 0))
    c.append(seq("GET is not covered: never replayed", [
        {"request": req(method="GET", body=""), "expect": ran(1, status=201)},
        {"request": req(method="GET", body=""), "expect": ran(2, status=201)}], 2))
    c.append(seq("PATCH is covered by default", [
        {"request": req(method="PATCH", path="/orders/7"), "expect": ran(1)},
        {"request": req(method="PATCH", path="/orders/7"), "expect": replay(1)}], 1))
    c.append(seq("configured methods: PUT covered, POST passes through", [
        {"request": req(method="PUT", path="/orders/7"), "expect": ran(1)},
        {"request": req(method="PUT", path="/orders/7"), "expect": replay(1)},
        {"request": req(), "expect": ran(2)},
        {"request": req(), "expect": ran(3)}], 3, methods=["PUT"]))
    c.append(seq("the key reused with another body: 422", [
        {"request": req(), "expect": ran(1)},
        {"request": req(body='{"sku":"B2","qty":1}'), "expect": refused(422, "key-reused")},
        {"request": req(), "expect": replay(1)}], 1))
    c.append(seq("the same JSON with other key order and whitespace is the same request", [
        {"request": req(), "expect": ran(1)},
        {"request": req(body='{ "qty" : 1, "sku" : "A1" }'), "expect": replay(1)}], 1))
    c.append(seq("another path of the same route with the same key: 422", [
        {"request": req(method="PATCH", path="/orders/1"), "expect": ran(1)},
        {"request": req(method="PATCH", path="/orders/2"), "expect": refused(422, "key-reused")}], 1))
    c.append(seq("another route with the same key is another operation", [
        {"request": req(), "expect": ran(1)},
        {"request": req(path="/payments"), "expect": ran(2)},
        {"request": req(path="/payments"), "expect": replay(2)}], 2))
    c.append(seq("another tenant with the same key is another operation", [
        {"request": req(tenant="acme"), "expect": ran(1)},
        {"request": req(tenant="globex"), "expect": ran(2)},
        {"request": req(tenant="acme"), "expect": replay(1)}], 2))
    c.append(seq("an empty tenant from the tenant function: 500 tenant-unusable (not an invalid key), handler not called", [
        {"request": req(tenant=""), "expect": refused(500, "tenant-unusable")},
        {"request": req(tenant=""), "expect": refused(500, "tenant-unusable")}], 0))
    c.append(seq("a 5xx is not stored: the retry runs again and its 201 is stored", [
        {"request": req(status=500), "expect": ran(1, status=500)},
        {"request": req(status=503), "expect": ran(2, status=503)},
        {"request": req(), "expect": ran(3)},
        {"request": req(status=500), "expect": replay(3)}], 3))
    for status in (408, 409, 425, 429, 303):
        c.append(seq(f"{status} is not stored", [
            {"request": req(status=status), "expect": ran(1, status=status)},
            {"request": req(), "expect": ran(2)}], 2))
    for status in (200, 202, 400, 404, 422):
        c.append(seq(f"{status} is stored", [
            {"request": req(status=status), "expect": ran(1, status=status)},
            {"request": req(), "expect": replay(1, status=status)}], 1))
    c.append(seq("a body over the cap is sent whole but not stored; the key is released", [
        {"request": req(nbytes=101), "expect": ran(1, body_len=101)},
        {"request": req(nbytes=101), "expect": ran(2, body_len=101)}], 2, body_cap=100))
    c.append(seq("a body at the cap is stored", [
        {"request": req(nbytes=100), "expect": ran(1, body_len=100)},
        {"request": req(nbytes=100), "expect": replay(1, body_len=100)}], 1, body_cap=100))
    c.append(seq("configured stored headers: set-cookie kept, etag dropped", [
        {"request": req(), "expect": ran(1)},
        {"request": req(), "expect": replay(1, headers={"set-cookie": "call=1", "etag": None, "x-call": None})}],
        1, stored_headers=["content-type", "set-cookie"]))
    c.append(seq("20 concurrent duplicates: the handler runs once, 19 replays of its response", [
        {"concurrent": 20, "request": req(delay_ms=200),
         "expect": {"status": 201, "call": 1, "replayed_count": 19}}], 1))
    c.append(seq("20 concurrent duplicates of a 500: one run, the waiters get its response", [
        {"concurrent": 20, "request": req(status=500, delay_ms=200),
         "expect": {"status": 500, "call": 1, "replayed_count": 19}},
        {"request": req(), "expect": ran(2)}], 2))
    c.append(seq("no-wait: a duplicate while the first runs gets 409 + Retry-After; later a replay", [
        {"background": req(delay_ms=1000)},
        {"wait_handler_calls": 1},
        {"request": req(), "expect": refused(409, "in-progress", headers={"retry-after": "1"})},
        {"await_background": True, "expect": ran(1)},
        {"request": req(), "expect": replay(1)}], 1, wait=False))
    c.append(seq("waiting: a duplicate while the first runs waits and replays it", [
        {"background": req(delay_ms=300)},
        {"wait_handler_calls": 1},
        {"request": req(), "expect": replay(1)},
        {"await_background": True, "expect": ran(1)}], 1))
    return c


# --------------------------------------------------------------------------------------
# result_codec.json: the stored form of a Redis store result (redis/README.md,
# "Result encoding"): one tag byte, then the body.

def codec_case(comment, kind, body, **fields):
    tag = {"json": b"j", "bytes": b"b", "no_value": b"n", "not_storable": b"x",
           "user_bytes": b"u", "user_text": b"t"}[kind]
    case = {"comment": comment, "record_hex": (tag + body).hex(), "kind": kind}
    case.update(fields)
    return case


def codec_error(comment, record):
    return {"comment": comment, "record_hex": record.hex(), "error": {"kind": "unavailable"}}


def result_codec_cases():
    d = []
    for comment, value in [
        ("an object", {"id": 7, "items": ["a", "b"], "ok": True}),
        ("non-ASCII text is stored as UTF-8, not escaped", {"name": "Zoë ✓ 🐍"}),
        ("null is a JSON value (not 'no value')", None),
        ("a bare string", "text"),
        ("numbers", [0, -1, 2.5, 1e21, 9007199254740991]),
        ("an empty array", []),
    ]:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        d.append(codec_case(comment, "json", text.encode("utf-8"), text=text, value=value))
    text = '{"b":1,  "a" : [ ]}'
    d.append(codec_case("any valid JSON is read (whitespace, member order)", "json",
                        text.encode("utf-8"), text=text, value={"b": 1, "a": []}))
    d.append(codec_case("bytes", "bytes", b"\x00\xffbin", hex=b"\x00\xffbin".hex()))
    d.append(codec_case("empty bytes", "bytes", b"", hex=""))
    d.append(codec_case("no value: Python None, JavaScript undefined", "no_value", b""))
    for name in ["decimal.Decimal", "datetime.datetime", "set", "float (NaN)", "Map",
                 "bigint", "Object (cyclic)"]:
        d.append(codec_case(f"not storable: a {name}", "not_storable", name.encode("utf-8"),
                            type_name=name))
    d.append(codec_case("user codec bytes (a pickle)", "user_bytes", b"\x80\x04K\x07.",
                        hex=b"\x80\x04K\x07.".hex()))
    d.append(codec_case("user codec text", "user_text", '{"at":"2024-05-01T12:00:00Z"}'.encode(),
                        text='{"at":"2024-05-01T12:00:00Z"}'))
    d.append(codec_error("empty: no tag", b""))
    d.append(codec_error("an unknown tag", b"x"[:0] + b"Q123"))
    d.append(codec_error("JSON that is not UTF-8", b"j\xff"))
    d.append(codec_error("a type name that is not UTF-8", b"x\xc3"))
    d.append(codec_error("no value with a body", b"nx"))
    return d


# --------------------------------------------------------------------------------------
# extraction.json: foreign error shapes -> code, retry decision, server delay (SPEC §3,
# "Extraction")
# --------------------------------------------------------------------------------------

BUILTIN_REASONS = {"UPSTREAM_UNAVAILABLE": "UNAVAILABLE", "RATE_LIMITED": "RESOURCE_EXHAUSTED",
                   "STOCK_CONFLICT": "ABORTED"}
OS_ERRORS = {
    "ECONNRESET": "UNAVAILABLE", "EPIPE": "UNAVAILABLE", "ECONNABORTED": "UNAVAILABLE",
    "ECONNREFUSED": "UNAVAILABLE", "EHOSTUNREACH": "UNAVAILABLE", "EHOSTDOWN": "UNAVAILABLE",
    "ENETUNREACH": "UNAVAILABLE", "ENETDOWN": "UNAVAILABLE", "ENETRESET": "UNAVAILABLE",
    "EAI_AGAIN": "UNAVAILABLE", "ENOTFOUND": "UNAVAILABLE",
    "ETIMEDOUT": "DEADLINE_EXCEEDED", "ESOCKETTIMEDOUT": "DEADLINE_EXCEEDED",
    "UND_ERR_CONNECT_TIMEOUT": "UNAVAILABLE", "UND_ERR_HEADERS_TIMEOUT": "DEADLINE_EXCEEDED",
    "UND_ERR_BODY_TIMEOUT": "DEADLINE_EXCEEDED", "UND_ERR_ABORTED": "CANCELLED",
    "ABORT_ERR": "CANCELLED", "UND_ERR_INVALID_ARG": "INVALID_ARGUMENT",
    "UND_ERR_INVALID_RETURN_VALUE": "INVALID_ARGUMENT", "UND_ERR_NOT_SUPPORTED": "UNIMPLEMENTED",
    "UND_ERR_SOCKET": "UNAVAILABLE", "UND_ERR_CLOSED": "UNAVAILABLE",
}
TYPE_NAMES = {
    "TimeoutError": "DEADLINE_EXCEEDED", "AbortError": "CANCELLED",
    "ConnectionResetError": "UNAVAILABLE", "ConnectionAbortedError": "UNAVAILABLE",
    "ConnectionRefusedError": "UNAVAILABLE", "BrokenPipeError": "UNAVAILABLE",
    "ConnectionError": "UNAVAILABLE", "socket.gaierror": "UNAVAILABLE",
    "socket.timeout": "DEADLINE_EXCEEDED", "asyncio.TimeoutError": "DEADLINE_EXCEEDED",
    "httpx.TimeoutException": "DEADLINE_EXCEEDED", "httpx.TransportError": "UNAVAILABLE",
    "requests.Timeout": "DEADLINE_EXCEEDED", "requests.ConnectionError": "UNAVAILABLE",
    "aiohttp.ServerTimeoutError": "DEADLINE_EXCEEDED",
    "aiohttp.ConnectionTimeoutError": "DEADLINE_EXCEEDED",
    "aiohttp.SocketTimeoutError": "DEADLINE_EXCEEDED",
    "aiohttp.ClientConnectionError": "UNAVAILABLE", "urllib3.TimeoutError": "DEADLINE_EXCEEDED",
    "urllib3.NewConnectionError": "UNAVAILABLE", "urllib3.ProtocolError": "UNAVAILABLE",
    "grpc.FutureTimeoutError": "DEADLINE_EXCEEDED",
}


def x_number(n):
    if isinstance(n, bool) or not isinstance(n, int):
        return None
    if 0 <= n <= 16:
        return CODES[n]
    if 100 <= n <= 599:
        return http_code(n)
    return None


def x_int_text(t):
    t = t.strip(" \t\n\r\f\v")
    if t and (t.isascii() and (t.isdigit() or (t[0] in "+-" and t[1:].isdigit()))):
        return int(t)
    return None


def x_os(name):
    u = name.strip().upper()
    if u in OS_ERRORS:
        return OS_ERRORS[u]
    return "UNAVAILABLE" if u.startswith("UND_ERR") else None


def x_text(t, reasons):
    t = t.strip()
    if not t or len(t.encode()) > 64:
        return None
    n = x_int_text(t)
    if n is not None:
        return x_number(n)
    u = t.upper() if t.isascii() else None
    if u is None:
        return None
    if u in CODES:
        return u
    if u in reasons:
        return reasons[u]
    return x_os(u)


def x_value(v, reasons, text_rules):
    if v is None:
        return None
    if isinstance(v, str):
        if text_rules:
            return x_text(v, reasons)
        n = x_int_text(v)
        return None if n is None else x_number(n)
    return x_number(v)


def x_level_code(shape, reasons):
    resp = shape.get("response") or {}
    status = shape.get("status", resp.get("status"))
    status_code = shape.get("status_code", resp.get("status_code"))
    return (x_value(shape.get("code"), reasons, True)
            or x_value(status, reasons, False)
            or x_value(status_code, reasons, False)
            or next((TYPE_NAMES[n] for n in shape.get("names", []) if n in TYPE_NAMES), None))


def x_header(shape, name):
    pairs = []
    for src in (shape.get("headers"), (shape.get("response") or {}).get("headers"),
                shape.get("metadata")):
        for k, v in (src or {}).items():
            pairs.append((k, v))
    for k, v in pairs:
        if k.strip().lower() == name:
            return v
    return None


def x_pushback(v):
    v = v.strip(" \t")  # optional whitespace: SP and HTAB only
    digits = v[1:] if v.startswith("-") else v
    if not digits or not (digits.isascii() and digits.isdigit()):
        return "do_not_retry"  # unparseable: do not retry (gRFC A6)
    if v.startswith("-") and int(digits) != 0:
        return "do_not_retry"
    return int(digits)


def pb_varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def pb_field(num, wire, payload):
    if wire == 0:
        return pb_varint(num << 3) + pb_varint(payload)
    return pb_varint((num << 3) | 2) + pb_varint(len(payload)) + payload


def status_details_bin(code, message, details, padded=True):
    """A google.rpc.Status with `details` [(type_url, payload bytes)], base64."""
    body = pb_field(1, 0, code) + pb_field(2, 2, message.encode())
    for type_url, payload in details:
        body += pb_field(3, 2, pb_field(1, 2, type_url.encode()) + pb_field(2, 2, payload))
    text = __import__("base64").b64encode(body).decode()
    return text if padded else text.rstrip("=")


def retry_info(seconds, nanos=0):
    duration = (pb_field(1, 0, seconds) if seconds else b"") + (pb_field(2, 0, nanos) if nanos else b"")
    return ("type.googleapis.com/google.rpc.RetryInfo", pb_field(1, 2, duration))


def x_retry_info(value):
    """Independent reading of the fixtures built above: decode and look for RetryInfo."""
    import base64 as b64
    v = value.strip().rstrip("=")
    try:
        raw = b64.b64decode(v + "=" * (-len(v) % 4), altchars=b"-_" if ("-" in v or "_" in v) else None,
                            validate=True)
    except Exception:
        return None

    def fields(b):
        i, out = 0, []
        while i < len(b):
            tag, i = rd(b, i)
            if tag & 7 == 0:
                val, i = rd(b, i)
            elif tag & 7 == 2:
                n, i = rd(b, i)
                val, i = b[i:i + n], i + n
                if i > len(b):
                    raise ValueError
            else:
                raise ValueError
            out.append((tag >> 3, val))
        return out

    def rd(b, i):
        n, shift = 0, 0
        while True:
            c = b[i]
            i += 1
            n |= (c & 0x7F) << shift
            shift += 7
            if not c & 0x80:
                return n, i
    try:
        for f, any_ in fields(raw):
            if f != 3:
                continue
            d = dict(fields(any_))
            if d.get(1) != b"type.googleapis.com/google.rpc.RetryInfo":
                continue
            dur = dict(fields(d.get(2, b""))).get(1, b"")
            dd = dict(fields(dur))
            return dd.get(1, 0) * 1000 + dd.get(2, 0) // 1_000_000
    except (ValueError, IndexError):
        return None
    return None


def x_delay(shape):
    """(delay_ms or None, do_not_retry) of the level that named the code."""
    p = x_header(shape, "grpc-retry-pushback-ms")
    if p is not None:
        r = x_pushback(p)
        return (None, True) if r == "do_not_retry" else (r, False)
    d = x_header(shape, "grpc-status-details-bin")
    if d is not None:
        ms = x_retry_info(d)
        if ms is not None:
            return ms, False
    ra = x_header(shape, "retry-after")
    if ra is not None:
        ra = ra.strip(" \t")
        if ra and ra.isascii() and ra.isdigit():
            return int(ra) * 1000, False
    return None, False


def x_extract(shape, reasons):
    level = shape
    for _ in range(5):
        if level is None:
            break
        code = x_level_code(level, reasons)
        if code is not None:
            return (code,) + x_delay(level)
        level = level.get("cause")
    return "UNKNOWN", None, False


def extraction_cases():
    c = []

    def case(comment, error, reasons=None):
        all_reasons = dict(BUILTIN_REASONS)
        all_reasons.update(reasons or {})
        code, delay_ms, dnr = x_extract(error, all_reasons)
        retryable, rule = spec_classify(code, True, False, False)
        out = {"comment": comment, "error": error}
        if reasons:
            out["reasons"] = reasons
        out.update({"code": code, "retryable": retryable, "rule": rule,
                    "delay_ms": delay_ms, "do_not_retry": dnr})
        c.append(out)

    # The shapes of a `code` that Python and Node once read differently.
    for v in ["RATE_LIMITED", 503, "unavailable", "14", "ECONNRESET", "ETIMEDOUT",
              "ECONNREFUSED", "EPIPE", 429, 502, "UNAVAILABLE", 14, "Unavailable", "503",
              "ENOTFOUND", "EAI_AGAIN", "RESOURCE_EXHAUSTED", 8, 4, "INTERNAL", 500,
              "UPSTREAM_UNAVAILABLE"]:
        case(f"code={v!r}", {"code": v})
    # Rule 3: numbers.
    for v in [0, 16, 17, 99, 100, 200, 404, 409, 599, 600, -1, 65535]:
        case(f"code={v}: 0-16 gRPC, 100-599 HTTP, else nothing", {"code": v})
    for v in ["0", " 14 ", "429", "+14", "-1", "600", "1e2", "14.0"]:
        case(f"code={v!r}: a number as text", {"code": v})
    # Every row of the §3 table, by the code's number and by the HTTP table.
    for n, name in enumerate(CODES):
        case(f"code={n} ({name})", {"code": n})
    for st in [400, 401, 403, 404, 408, 409, 412, 418, 429, 499, 500, 501, 502, 503, 504, 505, 204, 302]:
        case(f"status={st}: the HTTP table", {"status": st})
    case("status: an HTTP status", {"status": 503})
    case("status: 0-16 is a gRPC code", {"status": 14})
    case("status as text", {"status": "429"})
    case("status_code: an HTTP status", {"status_code": 429})
    case("status text that is not a number names nothing", {"status": "Service Unavailable"})
    case("code first, then status", {"code": "NOT_FOUND", "status": 503})
    case("an unknown code falls back to status", {"code": "ERR_BAD_RESPONSE", "status": 503})
    case("status before status_code", {"status": 404, "status_code": 503})
    case("a response's status", {"response": {"status": 502}})
    case("a response's status with Retry-After", {"response": {"status": 429, "headers": {"Retry-After": "3"}}})
    case("a response's status_code", {"response": {"status_code": 503}})
    # Rule 4: texts.
    for v in ["deadline_exceeded", "Aborted", "STOCK_CONFLICT", "stock_conflict", "rate_limited",
              "econnreset", "ECONNABORTED", "EHOSTUNREACH", "ENETUNREACH", "ESOCKETTIMEDOUT",
              "UND_ERR_SOCKET", "UND_ERR_HEADERS_TIMEOUT", "UND_ERR_SOMETHING_NEW",
              "UND_ERR_ABORTED", "ABORT_ERR", "UND_ERR_NOT_SUPPORTED", "ERR_SOMETHING", "",
              "   ", "NO_SUCH_REASON", "OK", "DATA_LOSS", "unauthenticated", "A" * 65]:
        case(f"code={v!r}", {"code": v})
    case("a registered reason", {"code": "PAYMENT_PENDING"}, reasons={"PAYMENT_PENDING": "UNAVAILABLE"})
    case("a registered reason, lower case", {"code": "payment_pending"},
         reasons={"PAYMENT_PENDING": "UNAVAILABLE"})
    case("a registered reason meaning a permanent code", {"code": "CARD_DECLINED"},
         reasons={"CARD_DECLINED": "FAILED_PRECONDITION"})
    # Type names (Python classes along the MRO, a JavaScript error's name).
    for names in [["TimeoutError"], ["AbortError"], ["ConnectionResetError"],
                  ["ConnectionRefusedError"], ["ConnectionAbortedError"], ["BrokenPipeError"],
                  ["ConnectionError"], ["socket.gaierror"],
                  ["httpx.ConnectTimeout", "httpx.TimeoutException", "httpx.TransportError"],
                  ["httpx.ConnectError", "httpx.NetworkError", "httpx.TransportError"],
                  ["requests.ConnectTimeout", "requests.ConnectionError", "requests.Timeout"],
                  ["requests.ReadTimeout", "requests.Timeout"],
                  ["aiohttp.ServerTimeoutError", "aiohttp.ServerConnectionError",
                   "aiohttp.ClientConnectionError"],
                  ["aiohttp.ClientConnectorError", "aiohttp.ClientOSError",
                   "aiohttp.ClientConnectionError"],
                  ["urllib3.NewConnectionError", "urllib3.TimeoutError"],
                  ["urllib3.ReadTimeoutError", "urllib3.TimeoutError"],
                  ["ValueError"], ["SomeAppError"]]:
        case(f"type names {names}", {"names": names})
    case("a code wins over the type names", {"code": "NOT_FOUND", "names": ["TimeoutError"]})
    # Chains.
    case("fetch failed: the cause is the socket error",
         {"names": ["TypeError"], "cause": {"code": "ECONNRESET"}})
    case("an outer code wins over its cause", {"code": "NOT_FOUND", "cause": {"code": "ECONNRESET"}})
    case("the delay is read from the level that named the code",
         {"headers": {"Retry-After": "9"}, "cause": {"code": 429, "headers": {"Retry-After": "2"}}})
    deep = {"code": "ECONNRESET"}
    for _ in range(4):
        deep = {"cause": deep}
    case("a cause four levels down is read", deep)
    case("a cause five levels down is not", {"cause": deep})
    case("nothing known: UNKNOWN", {})
    # Rule 5: server delays.
    case("Retry-After delta-seconds", {"status": 503, "headers": {"Retry-After": "120"}})
    case("Retry-After name in any case", {"status": 429, "headers": {"retry-after": "1"}})
    case("Retry-After zero", {"status": 429, "headers": {"Retry-After": "0"}})
    case("Retry-After with surrounding whitespace", {"status": 429, "headers": {"Retry-After": " 4\t"}})
    case("an unparseable Retry-After is ignored", {"status": 429, "headers": {"Retry-After": "soon"}})
    case("a negative Retry-After is ignored", {"status": 429, "headers": {"Retry-After": "-5"}})
    case("Retry-After on a permanent code", {"status": 400, "headers": {"Retry-After": "5"}})
    case("gRPC code with pushback", {"code": 14, "metadata": {"grpc-retry-pushback-ms": "250"}})
    case("pushback zero", {"code": 8, "metadata": {"grpc-retry-pushback-ms": "0"}})
    case("negative pushback: do not retry", {"code": 14, "metadata": {"grpc-retry-pushback-ms": "-1"}})
    case("unparseable pushback: do not retry (gRFC A6)",
         {"code": 14, "metadata": {"grpc-retry-pushback-ms": "soon"}})
    case("empty pushback: do not retry", {"code": 8, "metadata": {"grpc-retry-pushback-ms": ""}})
    case("pushback before Retry-After",
         {"code": 8, "headers": {"Retry-After": "9"}, "metadata": {"grpc-retry-pushback-ms": "100"}})
    ri = status_details_bin(8, "slow down", [retry_info(1, 500_000_000)])
    case("RetryInfo in grpc-status-details-bin", {"code": 8, "metadata": {"grpc-status-details-bin": ri}})
    case("RetryInfo, base64 without padding",
         {"code": 8, "metadata": {"grpc-status-details-bin": status_details_bin(8, "x", [retry_info(2)], padded=False)}})
    case("RetryInfo among other details",
         {"code": 14, "metadata": {"grpc-status-details-bin": status_details_bin(
             14, "busy", [("type.googleapis.com/google.rpc.ErrorInfo", pb_field(1, 2, b"QUOTA")),
                          retry_info(0, 250_000_000)])}})
    case("status details without RetryInfo: no delay",
         {"code": 14, "metadata": {"grpc-status-details-bin": status_details_bin(14, "busy", [])}})
    case("malformed status details are ignored",
         {"code": 14, "metadata": {"grpc-status-details-bin": "not base64!"}})
    case("pushback before RetryInfo",
         {"code": 8, "metadata": {"grpc-retry-pushback-ms": "50", "grpc-status-details-bin": ri}})
    case("RetryInfo before Retry-After",
         {"code": 8, "headers": {"Retry-After": "9"}, "metadata": {"grpc-status-details-bin": ri}})
    # Precedence: pushback, then RetryInfo, then Retry-After; a pushback that is present
    # decides even when it says "do not retry" or cannot be read.
    case("an unparseable pushback beats a valid Retry-After: do not retry",
         {"code": 14, "headers": {"Retry-After": "3"},
          "metadata": {"grpc-retry-pushback-ms": "soon"}})
    case("a negative pushback beats RetryInfo: do not retry",
         {"code": 8, "metadata": {"grpc-retry-pushback-ms": "-1", "grpc-status-details-bin": ri}})
    case("all three: the pushback wins",
         {"code": 8, "headers": {"Retry-After": "9"},
          "metadata": {"grpc-retry-pushback-ms": "75", "grpc-status-details-bin": ri}})
    case("malformed status details fall through to Retry-After",
         {"code": 8, "headers": {"Retry-After": "4"},
          "metadata": {"grpc-status-details-bin": "not base64!"}})
    case("an unparseable Retry-After does not hide RetryInfo",
         {"code": 8, "headers": {"Retry-After": "soon"}, "metadata": {"grpc-status-details-bin": ri}})
    case("pushback -0 is 0 ms, not do-not-retry",
         {"code": 14, "metadata": {"grpc-retry-pushback-ms": "-0"}})
    case("a pushback with a line break cannot be read: do not retry",
         {"code": 14, "metadata": {"grpc-retry-pushback-ms": "5\n"}})
    case("a Retry-After with a line break is ignored",
         {"code": 14, "headers": {"Retry-After": "\n5"}})
    return c


def write(name, cases):
    path = os.path.join(HERE, name)
    # One case per line: readable, and diffs show the cases that changed.
    lines = [json.dumps(case, ensure_ascii=False) for case in cases]
    text = "[\n" + ",\n".join(lines) + "\n]\n"
    assert json.loads(text) == cases
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
    return path, len(cases)


def main():
    files = {
        "backoff.json": backoff_cases(),
        "classification.json": classification_cases(),
        "http.json": http_cases(),
        "retry_after.json": retry_after_cases(),
        "keys.json": keys_cases(),
        "fingerprints.json": fingerprint_cases(),
        "retry_decisions.json": retry_decision_cases(),
        "budget.json": budget_cases(),
        "result_codec.json": result_codec_cases(),
        "http_server.json": http_server_cases(),
        "extraction.json": extraction_cases(),
    }
    for name, cases in files.items():
        path, n = write(name, cases)
        print(f"{n:5d} cases  {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
