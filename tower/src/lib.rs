//! # oncely-tower — idempotency keys for tower services
//!
//! The server contract of SPEC §8 as a tower layer (work in progress: the layer lands
//! in the next change).
#![deny(missing_docs)]
#![forbid(unsafe_code)]
