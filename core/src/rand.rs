//! The one random generator: SplitMix64, seeded per thread from the OS.
//!
//! Seeded jitter is a pure function of (seed, attempt), so every language gets the same
//! delays through the core; unseeded jitter draws a seed from a per-thread state that
//! getrandom initialises.

use std::cell::Cell;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 output function.
pub(crate) const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform value in `[0, 1)` for attempt `n` of the sequence named by `seed`.
pub(crate) fn unit(seed: u64, n: u32) -> f64 {
    let z = mix(seed.wrapping_add(u64::from(n).wrapping_mul(GOLDEN)));
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

thread_local! {
    static STATE: Cell<u64> = Cell::new(os_seed());
}

fn os_seed() -> u64 {
    let mut buf = [0u8; 8];
    match getrandom::fill(&mut buf) {
        Ok(()) => u64::from_le_bytes(buf),
        // No OS randomness: still spread threads apart rather than fail a retry.
        Err(_) => {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            let local = 0u8;
            mix(t ^ (&local as *const u8 as u64))
        }
    }
}

/// A fresh 64-bit value from this thread's generator.
pub(crate) fn next_u64() -> u64 {
    STATE.with(|s| {
        let next = s.get().wrapping_add(GOLDEN);
        s.set(next);
        mix(next)
    })
}

/// Fills `buf` with OS randomness (for keys), falling back to the thread generator.
pub(crate) fn fill(buf: &mut [u8]) {
    if getrandom::fill(buf).is_err() {
        for chunk in buf.chunks_mut(8) {
            let v = next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}
