//! The one error type of oncely: every variant names its gRPC [`Code`] and says
//! what to do about it.

use std::time::Duration;

use crate::code::Code;

/// Everything oncely itself can fail with.
///
/// Errors of the caller's own action are never wrapped in this type; they are given
/// back unchanged (see [`RetryError`](crate::RetryError) and
/// [`ExecuteError`](crate::ExecuteError)).
///
/// ```
/// use oncely::{Code, Error, IdempotencyKey};
/// let err: Error = IdempotencyKey::parse("no spaces allowed").unwrap_err();
/// assert_eq!(err.code(), Code::InvalidArgument);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting or an argument is out of range; `field` names it.
    #[error("invalid {field}: {reason}")]
    InvalidArgument {
        /// The name of the offending field or argument, e.g. `"max_attempts"`.
        field: &'static str,
        /// What is wrong with it and what is accepted instead.
        reason: String,
    },
    /// A write arrived without an idempotency key. A server names its protocol's key
    /// ([`http::Problem::from_error_in`](crate::http::Problem::from_error_in)); this
    /// message, without a protocol, names both.
    #[error(
        "write operations require an idempotency key (HTTP: the Idempotency-Key header; \
         gRPC: x-idempotency-key metadata)"
    )]
    MissingKey,
    /// The same scoped key was used with different request parameters.
    #[error(
        "idempotency key reused with different parameters: one key names one operation; \
         make a new key for a new operation"
    )]
    FingerprintMismatch,
    /// Another call with this key is still running and the caller chose not to wait.
    #[error("an operation with this idempotency key is in progress; retry after {retry_after:?}")]
    InProgress {
        /// How long to wait before retrying (HTTP `Retry-After`).
        retry_after: Duration,
    },
    /// The leader's claim on a key was taken over by another worker; its result was
    /// not stored.
    #[error(
        "the lease on this idempotency key was lost to another worker; the result was not stored"
    )]
    LeaseLost,
    /// The store is full of operations that are still running.
    #[error("the idempotency store is full ({max_entries} entries, all in flight); retry later")]
    Capacity {
        /// The configured bound.
        max_entries: usize,
    },
    /// The store could not be reached; nothing was executed.
    #[error("the idempotency store is unavailable: {0}")]
    Unavailable(String),
    /// The call this one was waiting for panicked while running its action.
    #[error("the leading call for this idempotency key panicked: {0}")]
    LeaderPanicked(String),
    /// An action called `execute` with the very key it is leading: it would wait for
    /// itself forever, so the inner call fails at once instead.
    #[error(
        "re-entrant execute: the action leading idempotency key {key} called execute with \
         the same key and would wait for itself forever; give the inner operation its own key"
    )]
    Reentrant {
        /// The scoped key (as `tenant/method/key`).
        key: String,
    },
    /// The operation ran and completed, but its result could not be stored (the store's
    /// codec cannot encode it, or it is over the store's size cap), so it cannot be
    /// replayed; it is not run again.
    #[error(
        "the operation with idempotency key {key} completed, but its result (a {type_name}) \
         could not be stored, so it cannot be replayed; the operation is not run again"
    )]
    ResultNotStored {
        /// The scoped key (as `tenant/method/key`).
        key: String,
        /// The host-language type of the result that could not be encoded, or, for a
        /// result over a size cap, its size and the cap.
        type_name: String,
    },
}

impl Error {
    /// The gRPC status code this error maps to.
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument { .. } | Error::MissingKey => Code::InvalidArgument,
            Error::FingerprintMismatch => Code::FailedPrecondition,
            Error::InProgress { .. } | Error::LeaseLost => Code::Aborted,
            Error::Capacity { .. } => Code::ResourceExhausted,
            Error::Unavailable(_) => Code::Unavailable,
            Error::LeaderPanicked(_) => Code::Internal,
            Error::Reentrant { .. } => Code::FailedPrecondition,
            Error::ResultNotStored { .. } => Code::DataLoss,
        }
    }

    /// A stable snake_case name of the variant, the same in every language (Node's
    /// `err.kind`, Python's `exc.kind`): `invalid_argument`, `missing_key`,
    /// `fingerprint_mismatch`, `in_progress`, `lease_lost`, `capacity`, `unavailable`,
    /// `leader_panicked`, `reentrant`, `result_not_stored`.
    ///
    /// ```
    /// assert_eq!(oncely::Error::MissingKey.kind(), "missing_key");
    /// ```
    pub const fn kind(&self) -> &'static str {
        match self {
            Error::InvalidArgument { .. } => "invalid_argument",
            Error::MissingKey => "missing_key",
            Error::FingerprintMismatch => "fingerprint_mismatch",
            Error::InProgress { .. } => "in_progress",
            Error::LeaseLost => "lease_lost",
            Error::Capacity { .. } => "capacity",
            Error::Unavailable(_) => "unavailable",
            Error::LeaderPanicked(_) => "leader_panicked",
            Error::Reentrant { .. } => "reentrant",
            Error::ResultNotStored { .. } => "result_not_stored",
        }
    }

    /// The HTTP status a server answers with this error:
    ///
    /// | error | status |
    /// |---|---|
    /// | `InvalidArgument` (a malformed or too short key among them), `MissingKey` | 400 |
    /// | `FingerprintMismatch` | 422 |
    /// | `InProgress` (send `Retry-After`), `LeaseLost` | 409 |
    /// | `Capacity`, `Unavailable` | 503 |
    /// | `LeaderPanicked`, `Reentrant`, `ResultNotStored` | 500 |
    ///
    /// ```
    /// use oncely::{Error, IdempotencyKey};
    /// assert_eq!(IdempotencyKey::parse("short").unwrap_err().http_status(), 400);
    /// assert_eq!(Error::FingerprintMismatch.http_status(), 422);
    /// ```
    pub const fn http_status(&self) -> u16 {
        use crate::key::http_status as h;
        match self {
            Error::InvalidArgument { .. } | Error::MissingKey => h::MISSING_KEY,
            Error::FingerprintMismatch => h::FINGERPRINT_MISMATCH,
            Error::InProgress { .. } | Error::LeaseLost => h::IN_PROGRESS,
            Error::Capacity { .. } | Error::Unavailable(_) => 503,
            Error::LeaderPanicked(_) | Error::Reentrant { .. } | Error::ResultNotStored { .. } => {
                500
            }
        }
    }

    /// For [`Error::InProgress`]: how long the caller should wait before retrying.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Error::InProgress { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_has_a_kind_and_an_http_status() {
        let all = [
            Error::invalid("max_attempts", "0"),
            Error::MissingKey,
            Error::FingerprintMismatch,
            Error::InProgress {
                retry_after: Duration::from_secs(1),
            },
            Error::LeaseLost,
            Error::Capacity { max_entries: 1 },
            Error::Unavailable("down".into()),
            Error::LeaderPanicked("boom".into()),
            Error::Reentrant { key: "k".into() },
            Error::ResultNotStored {
                key: "k".into(),
                type_name: "Set".into(),
            },
        ];
        let got: Vec<_> = all.iter().map(|e| (e.kind(), e.http_status())).collect();
        assert_eq!(
            got,
            [
                ("invalid_argument", 400),
                ("missing_key", 400),
                ("fingerprint_mismatch", 422),
                ("in_progress", 409),
                ("lease_lost", 409),
                ("capacity", 503),
                ("unavailable", 503),
                ("leader_panicked", 500),
                ("reentrant", 500),
                ("result_not_stored", 500),
            ]
        );
    }
}
