//! The record transitions: one Lua script each, every one checked against the lease
//! token. The record format is documented in the crate's README (format version 1).

use redis::{ParsingError, Value};

use crate::request::Request;

/// The record format version this crate reads and writes.
pub const RECORD_VERSION: &str = "1";

/// Shared prologue: `clock()`, Redis' clock in milliseconds (never a worker's clock),
/// read only by the branches that need it (each `redis.call` costs Redis about as much
/// as a plain command sent on its own); `ms(n)`, a time as integer text (Lua would write
/// a number with `%.14g`, the same digits for these values at several times the cost).
macro_rules! lua {
    ($body:expr) => {
        concat!(
            "local function clock()\n",
            "  local t = redis.call('TIME')\n",
            "  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n",
            "end\n",
            "local function ms(n) return string.format('%d', n) end\n",
            $body
        )
    };
}

/// KEYS[1] record; ARGV fingerprint, new token, lease ms, key TTL ms (max of the
/// retention and two leases).
/// → {'lead', generation} | {'replay', result} | {'notstored', type name}
///   | {'mismatch'} | {'running', ms left} | {'version', v}
/// `notstored`: completed, but the result was not stored (the `nostore` field, see
/// COMPLETE): never replayed as bytes.
/// Resent after a lost reply, it finds its own token and leads again (the lease
/// restarted), instead of waiting for itself. An absent key (the common case: a new
/// request) is found with `EXISTS`, cheaper for Redis than reading seven fields.
/// A running record without a `deadline` that is a number (foreign or damaged data)
/// has no lease to judge its leader by: it is given one from now, and answered as
/// running (a live leader's renewal keeps it; once it runs out, a claim takes over). A
/// missing `gen` counts as 1.
const CLAIM: &str = lua!(
    r#"
local function create()
  redis.call('HSET', KEYS[1], 'v', '1', 'state', 'running', 'fp', ARGV[1], 'token', ARGV[2],
    'deadline', ms(clock() + tonumber(ARGV[3])), 'gen', '1')
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {'lead', 1}
end
if redis.call('EXISTS', KEYS[1]) == 0 then return create() end
local r = redis.call('HMGET', KEYS[1], 'v', 'state', 'fp', 'deadline', 'gen', 'result', 'token',
  'nostore')
if r[1] and r[1] ~= '1' then return {'version', r[1]} end
if not r[2] then return create() end
if r[1] ~= '1' then return {'version', tostring(r[1])} end
if r[3] ~= ARGV[1] then return {'mismatch'} end
if r[2] == 'done' then
  if r[8] then return {'notstored', r[8]} end
  return {'replay', r[6] or ''}
end
local now = clock()
if r[7] == ARGV[2] then
  redis.call('HSET', KEYS[1], 'deadline', ms(now + tonumber(ARGV[3])))
  return {'lead', tonumber(r[5]) or 1}
end
local deadline = tonumber(r[4])
if not deadline then
  redis.call('HSET', KEYS[1], 'deadline', ms(now + tonumber(ARGV[3])))
  return {'running', tonumber(ARGV[3])}
end
local left = deadline - now
if left > 0 then return {'running', left} end
local gen = (tonumber(r[5]) or 1) + 1
redis.call('HSET', KEYS[1], 'token', ARGV[2], 'deadline', ms(now + tonumber(ARGV[3])), 'gen',
  ms(gen))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {'lead', gen}
"#
);

/// KEYS[1] record; ARGV fingerprint.
/// → {'done', result} | {'notstored', type name} (see CLAIM) | {'running', ms left}
///   | {'expired'} | {'absent'} | {'mismatch'} | {'version', v}
/// A running record without a `deadline` that is a number is `expired`: the waiter
/// claims, and the claim gives it a lease to be judged by (see CLAIM).
const PEEK: &str = lua!(
    r#"
local r = redis.call('HMGET', KEYS[1], 'v', 'state', 'fp', 'deadline', 'result', 'nostore')
if not r[2] then return {'absent'} end
if r[1] ~= '1' then return {'version', tostring(r[1])} end
if r[3] ~= ARGV[1] then return {'mismatch'} end
if r[2] == 'done' then
  if r[6] then return {'notstored', r[6]} end
  return {'done', r[5] or ''}
end
local deadline = tonumber(r[4])
if not deadline then return {'expired'} end
local left = deadline - clock()
if left > 0 then return {'running', left} end
return {'expired'}
"#
);

/// KEYS[1] record; ARGV token, lease ms. → 1 renewed | 0 lost
/// (A running record never expires under its leader: its key TTL is kept at least
/// one lease ahead.)
const RENEW: &str = lua!(
    r#"
local r = redis.call('HMGET', KEYS[1], 'state', 'token')
if r[1] ~= 'running' or r[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'deadline', ms(clock() + tonumber(ARGV[2])))
if redis.call('PTTL', KEYS[1]) < 2 * tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[2]))
end
return 1
"#
);

/// KEYS[1] record; ARGV token, result, retention ms, channel, publish mode (see
/// [`Scripts::publish`]), and, for a result that was not stored, its description
/// (written in `nostore`; `result` then holds the codec's not-storable record, for
/// readers that know no `nostore`).
/// → 1 stored (or already stored with this token: a resend after a lost reply) | 0 lost
/// The notification is best effort (`pcall`): a user without rights on the channel
/// still stores its result, and waiters find it by polling.
const COMPLETE: &str = lua!(
    r#"
local r = redis.call('HMGET', KEYS[1], 'state', 'token')
if r[1] == 'done' and r[2] == ARGV[1] then return 1 end
if r[1] ~= 'running' or r[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'result', ARGV[2], 'done_at', ms(clock()))
redis.call('HDEL', KEYS[1], 'deadline', 'nostore')
if ARGV[6] then redis.call('HSET', KEYS[1], 'nostore', ARGV[6]) end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.pcall(ARGV[5] == 'shard' and 'SPUBLISH' or 'PUBLISH', ARGV[4], 'done')
return 1
"#
);

/// KEYS[1] record; ARGV token, channel, publish mode. → 1 deleted | 0 not ours (left
/// alone, also when resent after it deleted). The notification is best effort, as in
/// COMPLETE.
const RELEASE: &str = lua!(
    r#"
local r = redis.call('HMGET', KEYS[1], 'state', 'token')
if r[1] ~= 'running' or r[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.pcall(ARGV[3] == 'shard' and 'SPUBLISH' or 'PUBLISH', ARGV[2], 'released')
return 1
"#
);

/// KEYS[1] record. → {'absent'} | {'version', v}
///   | {state ('running' | 'done'), fingerprint, generation, result, ms of lease left,
///     [the `nostore` description of a done record whose result was not stored]}
/// A hash without a `state` (not a record: foreign or damaged data) is absent, as the
/// claim sees it (it takes such a hash over), unless its `v` names another format
/// version: every script refuses those, with or without a `state`, so that instances of
/// two versions never take over or delete each other's records.
const GET: &str = lua!(
    r#"
local r = redis.call('HMGET', KEYS[1], 'v', 'state', 'fp', 'gen', 'result', 'deadline',
  'nostore')
if r[1] and r[1] ~= '1' then return {'version', r[1]} end
if not r[2] then return {'absent'} end
if r[1] ~= '1' then return {'version', tostring(r[1])} end
local left = 0
if r[2] == 'running' then left = math.max((tonumber(r[6]) or 0) - clock(), 0) end
local out = {r[2], r[3] or '', tonumber(r[4]) or 0, r[5] or '', left}
if r[2] == 'done' and r[7] then out[6] = r[7] end
return out
"#
);

/// KEYS[1] record. → {'absent'} | {'version', v} | {'token', t}: the identity of the
/// record a removal is about (the token of the claim that wrote it; '' for a hash
/// without one). Writes nothing.
const IDENTIFY: &str = lua!(
    r#"
local r = redis.call('HMGET', KEYS[1], 'v', 'state', 'token')
if (r[1] or r[2]) and r[1] ~= '1' then return {'version', tostring(r[1])} end
if not r[2] and redis.call('EXISTS', KEYS[1]) == 0 then return {'absent'} end
return {'token', r[3] or ''}
"#
);

/// KEYS[1] record; ARGV channel, token (from IDENTIFY), lease ms, publish mode. → 1
///   removed | 0 absent
///   | {'other'} (another claim's record: left alone) | {'running', ms left} (a live
///   lease: left alone, its leader may still be running) | {'version', v}
/// Only the record IDENTIFY saw is deleted, so a resend after a lost reply finds it
/// gone, or a record a new claim made since (another token), and leaves that alone. A
/// hash without a `state` is deleted (the claim would take it over), unless its `v`
/// names another format version. A running record without a `deadline` that is a
/// number is given a lease from now and left alone, as a claim does (see CLAIM): it is
/// removed once that lease ran out. Waiters are told, as after a release, so that one
/// claims again at once.
const REMOVE: &str = lua!(
    r#"
local r = redis.call('HMGET', KEYS[1], 'v', 'state', 'deadline', 'token')
if not r[2] and redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if r[1] and r[1] ~= '1' then return {'version', r[1]} end
if (r[4] or '') ~= ARGV[2] then return {'other'} end
if r[2] then
  if r[1] ~= '1' then return {'version', tostring(r[1])} end
  if r[2] == 'running' then
    local now = clock()
    local deadline = tonumber(r[3])
    if not deadline then
      redis.call('HSET', KEYS[1], 'deadline', ms(now + tonumber(ARGV[3])))
      return {'running', tonumber(ARGV[3])}
    end
    if deadline - now > 0 then return {'running', deadline - now} end
  end
end
redis.call('DEL', KEYS[1])
redis.pcall(ARGV[4] == 'shard' and 'SPUBLISH' or 'PUBLISH', ARGV[1], 'released')
return 1
"#
);

/// A script of one key, sent as `EVALSHA` (loaded and sent again when Redis does not
/// know it, see [`crate::pipeline::pipeline`]).
pub(crate) struct Lua {
    code: &'static str,
    hash: String,
}

impl Lua {
    pub(crate) fn new(code: &'static str) -> Self {
        Lua {
            code,
            hash: redis::Script::new(code).get_hash().to_owned(),
        }
    }

    /// A call of this script on `key`; its arguments follow with [`Request::arg`].
    pub(crate) fn on(&self, key: &str) -> Request {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.hash).arg(1).arg(key);
        Request::script(cmd, self.code, key)
    }
}

/// The scripts of the record transitions.
pub(crate) struct Scripts {
    pub claim: Lua,
    pub peek: Lua,
    pub renew: Lua,
    pub complete: Lua,
    pub release: Lua,
    pub get: Lua,
    pub identify: Lua,
    pub remove: Lua,
    /// The notification's publish mode, an argument of the complete, release and
    /// remove scripts (the last one, but for the complete script's optional not-stored
    /// text after it): `shard` (`SPUBLISH`, on a Cluster: the channel carries the
    /// record key's hash tag, so only the key's shard hears it) or `all` (`PUBLISH`).
    pub publish: &'static str,
}

impl Scripts {
    /// The scripts; `sharded` on a Cluster (see [`Scripts::publish`]).
    pub(crate) fn new(sharded: bool) -> Self {
        Scripts {
            claim: Lua::new(CLAIM),
            peek: Lua::new(PEEK),
            renew: Lua::new(RENEW),
            complete: Lua::new(COMPLETE),
            release: Lua::new(RELEASE),
            get: Lua::new(GET),
            identify: Lua::new(IDENTIFY),
            remove: Lua::new(REMOVE),
            publish: if sharded { "shard" } else { "all" },
        }
    }
}

/// What the claim script found.
#[derive(Debug)]
pub(crate) enum Claim {
    Lead {
        generation: u64,
    },
    Replay(Vec<u8>),
    /// Completed, but the result was not stored: its description.
    NotStored(String),
    Mismatch,
    Running {
        left_ms: u64,
    },
    Version(String),
    /// Led, but fewer replicas than wanted acknowledged the claim: released.
    Unreplicated {
        acked: usize,
        wanted: usize,
    },
}

/// What a waiter's look at the record found.
#[derive(Debug)]
pub(crate) enum Peek {
    Done(Vec<u8>),
    /// Completed, but the result was not stored: its description.
    NotStored(String),
    Running {
        left_ms: u64,
    },
    /// Absent, expired lease, another operation's record, or another format
    /// version: claim again (the claim reports what it finds).
    Gone,
}

fn bad_reply(v: &Value) -> ParsingError {
    format!("unexpected reply from an oncely script: {v:?}").into()
}

fn parts(v: Value) -> Result<(String, Option<Value>), ParsingError> {
    let Value::Array(mut items) = v else {
        return Err(bad_reply(&v));
    };
    if items.is_empty() || items.len() > 2 {
        return Err(bad_reply(&Value::Array(items)));
    }
    let second = (items.len() == 2).then(|| items.pop()).flatten();
    let tag: String = redis::from_redis_value(items.pop().unwrap_or(Value::Nil))?;
    Ok((tag, second))
}

/// The error for a reply of `script` whose tag is unknown (written out only then: the
/// replies of every call go through here).
fn unknown_tag(script: &str, tag: &str, second: Option<&Value>) -> ParsingError {
    format!("unexpected reply from the {script} script: [{tag:?}, {second:?}]").into()
}

fn int(v: Option<Value>) -> Result<u64, ParsingError> {
    let v = v.unwrap_or(Value::Nil);
    let n: i64 = redis::from_redis_value_ref(&v)?;
    u64::try_from(n).map_err(|_| bad_reply(&v))
}

fn bytes(v: Option<Value>) -> Result<Vec<u8>, ParsingError> {
    match v {
        None | Some(Value::Nil) => Ok(Vec::new()),
        Some(v) => redis::from_redis_value(v),
    }
}

fn text(v: Option<Value>) -> String {
    v.and_then(|v| redis::from_redis_value::<String>(v).ok())
        .unwrap_or_default()
}

/// Whether a claim script's reply is a lead (a write that `min_replicas` must cover).
pub(crate) fn claim_led(v: &Value) -> bool {
    let Value::Array(parts) = v else {
        return false;
    };
    parts
        .first()
        .and_then(|tag| redis::from_redis_value_ref::<String>(tag).ok())
        .is_some_and(|tag| tag == "lead")
}

/// Whether a remove script's reply says the record is gone (deleted by this call, or
/// found deleted): the deletion the replicas must have.
pub(crate) fn removal_gone(v: &Value) -> bool {
    matches!(v, Value::Int(1) | Value::Int(0))
}

/// Whether an identify script's reply says there is no record (see
/// [`removal_gone`]).
pub(crate) fn identity_absent(v: &Value) -> bool {
    matches!(v, Value::Array(items) if items.len() == 1)
}

/// Whether a complete script's reply says the result was stored.
pub(crate) fn completion_stored(v: &Value) -> bool {
    matches!(v, Value::Int(1))
}

impl redis::FromRedisValue for Claim {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        let (tag, second) = parts(v)?;
        Ok(match tag.as_str() {
            "lead" => Claim::Lead {
                generation: int(second)?,
            },
            "replay" => Claim::Replay(bytes(second)?),
            "notstored" => Claim::NotStored(text(second)),
            "mismatch" => Claim::Mismatch,
            "running" => Claim::Running {
                left_ms: int(second)?,
            },
            "version" => Claim::Version(text(second)),
            _ => return Err(unknown_tag("claim", &tag, second.as_ref())),
        })
    }
}

impl redis::FromRedisValue for Peek {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        let (tag, second) = parts(v)?;
        Ok(match tag.as_str() {
            "done" => Peek::Done(bytes(second)?),
            "notstored" => Peek::NotStored(text(second)),
            "running" => Peek::Running {
                left_ms: int(second)?,
            },
            "expired" | "absent" | "mismatch" | "version" => Peek::Gone,
            _ => return Err(unknown_tag("peek", &tag, second.as_ref())),
        })
    }
}

/// What the get script found.
#[derive(Debug)]
pub(crate) enum Got {
    Absent,
    Version(String),
    Record {
        done: bool,
        fingerprint: String,
        generation: u64,
        result: Vec<u8>,
        left_ms: u64,
        /// Done, but the result was not stored: its description.
        not_stored: Option<String>,
    },
}

impl redis::FromRedisValue for Got {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        // Written out only for a reply of an unexpected shape: a record's result may be
        // hundreds of MiB, and its text many times that.
        let Value::Array(items) = v else {
            return Err(bad_reply(&v));
        };
        let tag: String = redis::from_redis_value_ref(items.first().unwrap_or(&Value::Nil))?;
        let expected = matches!(
            (tag.as_str(), items.len().saturating_sub(1)),
            ("absent", 0) | ("version", 1) | ("running" | "done", 4 | 5)
        );
        if !expected {
            return Err(format!(
                "unexpected reply from the get script: {:?}",
                Value::Array(items)
            )
            .into());
        }
        let mut items = items.into_iter().skip(1);
        Ok(match (tag.as_str(), items.len()) {
            ("absent", 0) => Got::Absent,
            ("version", 1) => Got::Version(text(items.next())),
            ("running" | "done", 4 | 5) => Got::Record {
                done: tag == "done",
                fingerprint: text(items.next()),
                generation: int(items.next())?,
                result: bytes(items.next())?,
                left_ms: int(items.next())?,
                not_stored: items
                    .next()
                    .filter(|v| !matches!(v, Value::Nil))
                    .map(|v| text(Some(v))),
            },
            _ => return Err("unexpected reply from the get script".into()),
        })
    }
}

/// Which record a removal is about (what the identify script found).
#[derive(Debug)]
pub(crate) enum Identity {
    Absent,
    Version(String),
    /// The token of the claim that wrote the record ('' for a hash without one).
    Token(String),
}

impl redis::FromRedisValue for Identity {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        let (tag, second) = parts(v)?;
        Ok(match tag.as_str() {
            "absent" => Identity::Absent,
            "version" => Identity::Version(text(second)),
            "token" => Identity::Token(text(second)),
            _ => return Err(unknown_tag("identify", &tag, second.as_ref())),
        })
    }
}

/// What the remove script did.
#[derive(Debug)]
pub(crate) enum Removal {
    Deleted,
    Absent,
    /// Another claim's record (not the one identified): left alone.
    Other,
    /// A live lease: left alone.
    Running,
    Version(String),
}

impl redis::FromRedisValue for Removal {
    fn from_redis_value(v: Value) -> Result<Self, ParsingError> {
        match v {
            Value::Int(1) => Ok(Removal::Deleted),
            Value::Int(0) => Ok(Removal::Absent),
            v => {
                let (tag, second) = parts(v)?;
                Ok(match tag.as_str() {
                    "other" => Removal::Other,
                    "running" => Removal::Running,
                    "version" => Removal::Version(text(second)),
                    _ => return Err(unknown_tag("remove", &tag, second.as_ref())),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::url;
    use redis::FromRedisValue;

    /// The get script's replies: a record with or without the not-stored text (a nil
    /// in its place is none), absent, another version; any other shape is an error
    /// naming the reply.
    #[test]
    fn get_replies_are_read_by_their_shape() {
        let s = |t: &str| Value::BulkString(t.as_bytes().to_vec());
        let record = |extra: Option<Value>| {
            let mut v = vec![s("done"), s("fp"), Value::Int(2), s("r"), Value::Int(0)];
            v.extend(extra);
            Got::from_redis_value(Value::Array(v))
        };
        for extra in [None, Some(Value::Nil)] {
            assert!(matches!(
                record(extra),
                Ok(Got::Record { done: true, generation: 2, ref result, not_stored: None, .. })
                    if result == b"r"
            ));
        }
        assert!(matches!(
            record(Some(s("too big"))),
            Ok(Got::Record { not_stored: Some(ref n), .. }) if n == "too big"
        ));
        assert!(matches!(
            Got::from_redis_value(Value::Array(vec![s("absent")])),
            Ok(Got::Absent)
        ));
        assert!(matches!(
            Got::from_redis_value(Value::Array(vec![s("version"), s("2")])),
            Ok(Got::Version(ref v)) if v == "2"
        ));
        for bad in [
            Value::Array(vec![s("done"), s("fp"), Value::Int(2), s("r")]),
            Value::Array(vec![s("absent"), s("x")]),
            Value::Array(vec![s("other")]),
            Value::Array(vec![]),
            Value::Int(1),
        ] {
            let e = Got::from_redis_value(bad.clone()).map(|_| ()).unwrap_err();
            assert!(!e.to_string().is_empty(), "{bad:?}");
        }
    }

    /// The replies of PEEK and CLAIM (its own token resent) on a running record without
    /// a `deadline` (or with one that is no number) and without a `gen`: a waiter's
    /// look answers `expired` (it claims again, and the claim gives the record a lease),
    /// a claim resent leads with generation 1; neither is a Lua error.
    #[test]
    #[ignore = "needs a Redis: run scripts/test-redis"]
    fn peek_and_a_resent_claim_read_a_running_record_without_deadline_or_gen() {
        let mut c = redis::Client::open(url())
            .unwrap()
            .get_connection()
            .unwrap();
        let k = format!(
            "{{scripts-test:{}}}",
            oncely::IdempotencyKey::random().as_str()
        );
        for deadline in [None, Some("soon")] {
            let _: () = redis::cmd("DEL").arg(&k).query(&mut c).unwrap();
            let mut hset = redis::cmd("HSET");
            hset.arg(&k)
                .arg(&["v", "1", "state", "running", "fp", "fp", "token", "t"]);
            if let Some(d) = deadline {
                hset.arg(&["deadline", d]);
            }
            let _: () = hset.query(&mut c).unwrap();
            let peek: Vec<String> = redis::Script::new(PEEK)
                .key(&k)
                .arg("fp")
                .invoke(&mut c)
                .unwrap();
            assert_eq!(peek, ["expired"], "deadline {deadline:?}");
            let claim: Claim = redis::Script::new(CLAIM)
                .key(&k)
                .arg("fp")
                .arg("t")
                .arg(1000)
                .arg(60_000)
                .invoke(&mut c)
                .unwrap();
            assert!(
                matches!(claim, Claim::Lead { generation: 1 }),
                "deadline {deadline:?}: {claim:?}"
            );
        }
        let _: () = redis::cmd("DEL").arg(&k).query(&mut c).unwrap();
    }

    /// A completion without a not-stored text clears a `nostore` left in a hash the
    /// claim took over (no `state`: not a record), so its result is replayed; one with a
    /// text is read as not stored by CLAIM, PEEK and GET, also when resent.
    #[test]
    #[ignore = "needs a Redis: run scripts/test-redis"]
    fn complete_writes_and_clears_nostore() {
        let mut c = redis::Client::open(url())
            .unwrap()
            .get_connection()
            .unwrap();
        let k = format!(
            "{{scripts-test:{}}}",
            oncely::IdempotencyKey::random().as_str()
        );
        let claim = |c: &mut redis::Connection, token: &str| -> Claim {
            redis::Script::new(CLAIM)
                .key(&k)
                .arg("fp")
                .arg(token)
                .arg(10_000)
                .arg(60_000)
                .invoke(c)
                .unwrap()
        };
        let complete = |c: &mut redis::Connection, token: &str, nostore: Option<&str>| -> i64 {
            let script = redis::Script::new(COMPLETE);
            let mut call = script.key(&k);
            call.arg(token).arg("r").arg(60_000).arg("ch").arg("all");
            if let Some(n) = nostore {
                call.arg(n);
            }
            call.invoke(c).unwrap()
        };
        let peek = |c: &mut redis::Connection| -> Peek {
            redis::Script::new(PEEK)
                .key(&k)
                .arg("fp")
                .invoke(c)
                .unwrap()
        };
        let get = |c: &mut redis::Connection| -> Got {
            redis::Script::new(GET).key(&k).invoke(c).unwrap()
        };
        let _: () = redis::cmd("HSET")
            .arg(&k)
            .arg(&["nostore", "stray"])
            .query(&mut c)
            .unwrap();
        assert!(matches!(claim(&mut c, "t1"), Claim::Lead { .. }));
        assert_eq!(complete(&mut c, "t1", None), 1);
        assert!(matches!(claim(&mut c, "t2"), Claim::Replay(r) if r == b"r"));
        assert!(matches!(peek(&mut c), Peek::Done(r) if r == b"r"));
        let got = get(&mut c);
        assert!(
            matches!(
                got,
                Got::Record {
                    not_stored: None,
                    ..
                }
            ),
            "{got:?}"
        );

        let _: () = redis::cmd("DEL").arg(&k).query(&mut c).unwrap();
        assert!(matches!(claim(&mut c, "t3"), Claim::Lead { .. }));
        for _ in 0..2 {
            assert_eq!(complete(&mut c, "t3", Some("too big")), 1);
            assert!(matches!(claim(&mut c, "t4"), Claim::NotStored(n) if n == "too big"));
            assert!(matches!(peek(&mut c), Peek::NotStored(n) if n == "too big"));
            assert!(matches!(
                get(&mut c),
                Got::Record { done: true, not_stored: Some(n), .. } if n == "too big"
            ));
        }
        let _: () = redis::cmd("DEL").arg(&k).query(&mut c).unwrap();
    }
}
