//! Inputs shared by the groups.

use super::*;

pub(crate) const TENANT: &str = "tenant-1";
pub(crate) const METHOD: &str = "/shop.Orders/Create";

/// A realistic scoped key whose idempotency key is a UUID-shaped string made from
/// `i` (no syscall per key, unlike `IdempotencyKey::random`, so that making a million
/// of them stays cheap).
pub(crate) fn key_n(i: u64) -> ScopedKey {
    let mut z = i.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut word = || {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    };
    let (a, b) = (word(), word());
    let uuid = format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        (b >> 48) & 0x3fff | 0x8000,
        b & 0xffff_ffff_ffff
    );
    ScopedKey::new(TENANT, METHOD, &IdempotencyKey::parse(&uuid).unwrap()).unwrap()
}

pub(crate) fn random_key() -> ScopedKey {
    ScopedKey::new(TENANT, METHOD, &IdempotencyKey::random()).unwrap()
}

pub(crate) fn request_fingerprint() -> String {
    oncely::fingerprint(&serde_json::json!({"sku": "A1", "qty": 1, "price": "9.99"})).unwrap()
}

pub(crate) fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

pub(crate) type SharedU64 = Shared<BoxFuture<'static, u64>>;

/// The single-flight a user might write by hand: a map of shared futures.
#[derive(Default)]
pub(crate) struct NaiveShared {
    map: Mutex<HashMap<String, SharedU64>>,
}

impl NaiveShared {
    pub(crate) async fn get_with<F>(&self, key: &str, init: F) -> u64
    where
        F: Future<Output = u64> + Send + 'static,
    {
        let fut = {
            let mut map = self.map.lock().unwrap();
            match map.get(key) {
                Some(f) => f.clone(),
                None => {
                    let f = init.boxed().shared();
                    map.insert(key.to_owned(), f.clone());
                    f
                }
            }
        };
        fut.await
    }
}
