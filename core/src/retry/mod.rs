//! The retry loop (SPEC §4): the sans-IO [`RetryState`], the async and blocking loops
//! over it, and [`simulate`].

mod run;
mod simulate;
mod state;

pub use run::{
    retry, retry_blocking, Attempt, NoHook, OnRetry, Retry, RetryError, RetryEvent, RetryFuture,
    Sleeper, TimerSleeper,
};
pub use simulate::{simulate, Scripted, Simulation, Step, Timeline};
pub use state::{Decision, RetryState, StopReason};
