//! How a caller names settings and durations, so that the messages the core formats
//! speak the caller's language: Rust's `lease` and `30ms`, Python's `lease` in seconds,
//! Node's `leaseMs` in milliseconds.

use std::time::Duration;

/// The unit a caller gives durations in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DurationUnit {
    /// A [`Duration`], shown in Rust's `Debug` form (`30ms`).
    Duration,
    /// Seconds as a number (Python).
    Seconds,
    /// Milliseconds as a number (Node).
    Milliseconds,
}

/// A caller's names for the core's settings and its unit for durations. The core's
/// validation errors name the field and format the values with it, so each binding
/// validates with the core's rules and still reports its own option names.
///
/// ```
/// use std::time::Duration;
/// use oncely::{DurationUnit, Naming};
/// fn node(field: &'static str) -> &'static str {
///     if field == "lease" { "leaseMs" } else { field }
/// }
/// let naming = Naming::new(node, DurationUnit::Milliseconds);
/// assert_eq!(naming.field("lease"), "leaseMs");
/// assert_eq!(naming.duration(Duration::from_millis(30)), "30 (milliseconds)");
/// assert_eq!(Naming::RUST.duration(Duration::from_millis(30)), "30ms");
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Naming {
    rename: fn(&'static str) -> &'static str,
    unit: DurationUnit,
}

impl Naming {
    /// Rust's own names (`max_delay`) and `Duration`s.
    pub const RUST: Naming = Naming {
        rename: same,
        unit: DurationUnit::Duration,
    };

    /// The core's names, durations in seconds (as Python gives them).
    pub const SECONDS: Naming = Naming {
        rename: same,
        unit: DurationUnit::Seconds,
    };

    /// A caller's names (`rename` maps the core's field name to the caller's) and unit.
    pub const fn new(rename: fn(&'static str) -> &'static str, unit: DurationUnit) -> Self {
        Naming { rename, unit }
    }

    /// The caller's name for the core's `field`.
    pub fn field(&self, field: &'static str) -> &'static str {
        (self.rename)(field)
    }

    /// The unit durations are given in.
    pub const fn unit(&self) -> DurationUnit {
        self.unit
    }

    /// `d` as the caller writes it, with the unit: `30ms`, `0.03 (seconds)`,
    /// `30 (milliseconds)`.
    pub fn duration(&self, d: Duration) -> String {
        match self.unit {
            DurationUnit::Duration => format!("{d:?}"),
            DurationUnit::Seconds => format!("{} (seconds)", number(d.as_secs_f64())),
            DurationUnit::Milliseconds => {
                format!("{} (milliseconds)", number(d.as_secs_f64() * 1000.0))
            }
        }
    }

    /// `d` as the caller writes it, without the unit: `30ms`, `0.03`, `30` (for
    /// "got …" after a bound that gave the unit).
    pub fn value(&self, d: Duration) -> String {
        match self.unit {
            DurationUnit::Duration => format!("{d:?}"),
            DurationUnit::Seconds => number(d.as_secs_f64()),
            DurationUnit::Milliseconds => number(d.as_secs_f64() * 1000.0),
        }
    }
}

impl Default for Naming {
    fn default() -> Self {
        Naming::RUST
    }
}

fn same(field: &'static str) -> &'static str {
    field
}

/// A number without a needless fraction (`30`, `0.03`, `1.5`).
fn number(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_in_each_unit() {
        let d = Duration::from_millis(1500);
        assert_eq!(Naming::RUST.duration(d), "1.5s");
        assert_eq!(Naming::SECONDS.duration(d), "1.5 (seconds)");
        assert_eq!(
            Naming::new(same, DurationUnit::Milliseconds).duration(d),
            "1500 (milliseconds)"
        );
        assert_eq!(Naming::SECONDS.value(Duration::ZERO), "0");
    }
}
