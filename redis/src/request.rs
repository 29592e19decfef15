//! One call as the store's threads send it to Redis ([`Request`]), and why a call gave
//! no value ([`Failure`]).

use std::time::Duration;

use oncely::Error;

/// Redis could not be reached or answered with an error: UNAVAILABLE, fail closed.
pub(crate) fn unavailable(e: &redis::RedisError) -> Error {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connection_refusal() {
        "connection refused"
    } else if e.is_io_error() {
        "connection failed"
    } else {
        "error"
    };
    Error::Unavailable(format!("Redis {what}: {e}"))
}

/// Why a call gave no value.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// Its deadline passed before it could be sent: Redis never saw it.
    NotSent,
    /// Redis could not be reached or answered with an error.
    Redis(redis::RedisError),
    /// Connecting failed: nothing was sent.
    NotConnected(redis::RedisError),
}

impl From<redis::RedisError> for Failure {
    fn from(e: redis::RedisError) -> Self {
        Failure::Redis(e)
    }
}

impl Failure {
    /// Redis may have run the call but its answer was lost (a broken connection, a
    /// timeout): what it did is undone by the caller where it can be.
    pub(crate) fn is_lost_answer(&self) -> bool {
        matches!(self, Failure::Redis(e) if e.is_timeout() || e.is_io_error())
    }

    /// The failure of a call sent again after its reply was lost: whatever became of
    /// the resend (no connection, an error reply such as `LOADING`, no time left), the
    /// first send may have run, so it is a lost answer.
    pub(crate) fn after_resend(self) -> Failure {
        if self.is_lost_answer() {
            return self;
        }
        Failure::Redis(redis::RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            format!("the reply was lost and sending it again failed: {self:?}"),
        )))
    }

    pub(crate) fn into_error(self, io_timeout: Duration) -> Error {
        match self {
            Failure::NotSent => Error::Unavailable(format!(
                "Redis timed out: the call could not start within its I/O timeout \
                 ({io_timeout:?}), taken by the calls ahead of it or by connecting; it \
                 was not sent"
            )),
            Failure::Redis(e) | Failure::NotConnected(e) => unavailable(&e),
        }
    }
}

/// One command of a pipeline: a plain command, or a script call sent as `EVALSHA`
/// (see [`crate::scripts::Lua::on`]).
#[derive(Clone)]
pub(crate) struct Request {
    pub(crate) cmd: redis::Cmd,
    /// The script's source, for a script call: loaded when Redis answers NOSCRIPT.
    pub(crate) script: Option<&'static str>,
    /// The key a script call is on: on a Cluster the request goes to its slot's
    /// primary (see [`crate::cluster`]).
    key: Option<String>,
    /// A write that must be on [`Link::min_replicas`](crate::conn::Link::min_replicas)
    /// replicas when its reply passes this test: a `WAIT` follows it on the same
    /// connection (see [`run_batch`](crate::batch::run_batch)).
    pub(crate) replicated: Option<fn(&redis::Value) -> bool>,
}

impl Request {
    /// A plain command, e.g. `Request::command("PUBLISH").arg(channel).arg("x")`.
    pub(crate) fn command(name: &str) -> Self {
        Request {
            cmd: redis::cmd(name),
            script: None,
            key: None,
            replicated: None,
        }
    }

    /// A call of the script `code` (an `EVALSHA` of its hash) on `key`.
    pub(crate) fn script(cmd: redis::Cmd, code: &'static str, key: &str) -> Self {
        Request {
            cmd,
            script: Some(code),
            key: Some(key.to_owned()),
            replicated: None,
        }
    }

    /// Marks this write as one that must reach the store's `min_replicas` replicas
    /// when `wrote(reply)` holds (a claim that led, a completion that stored).
    pub(crate) fn replicated(mut self, wrote: fn(&redis::Value) -> bool) -> Self {
        self.replicated = Some(wrote);
        self
    }

    /// The key the request is routed by on a Cluster (none: any node).
    pub(crate) fn key_bytes(&self) -> &[u8] {
        self.key.as_deref().unwrap_or("").as_bytes()
    }

    /// The script's source, for a script call.
    pub(crate) fn script_code(&self) -> Option<&'static str> {
        self.script
    }

    /// Appends the request, encoded, to `bytes`.
    pub(crate) fn write(&self, bytes: &mut Vec<u8>) {
        self.cmd.write_packed_command(bytes);
    }

    /// Appends an argument.
    pub(crate) fn arg(mut self, arg: impl redis::ToRedisArgs) -> Self {
        self.cmd.arg(arg);
        self
    }
}
