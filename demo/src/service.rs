//! The simulated service.

use super::*;

pub(crate) const TENANT: &str = "shop";
pub(crate) const METHOD: &str = "/inventory.Stock/Deduct";

/// What the service does with one request; a pure function of (seed, order, attempt),
/// so a seeded run gives the same counts whatever the thread scheduling, and the three
/// strategies face the very same faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    FailBefore,
    Throttle,
    DropResponse,
    None,
}

/// One request on the wire: the intent, the attempt number (sent as
/// `grpc-previous-rpc-attempts` would be) and, for oncely, the idempotency key
/// (`x-idempotency-key`).
pub(crate) struct Request {
    pub(crate) order: u32,
    pub(crate) qty: u32,
    pub(crate) attempt: u32,
    pub(crate) key: Option<IdempotencyKey>,
}

/// The receipt of a stock deduction.
pub(crate) type Receipt = u64;

pub(crate) struct Service {
    pub(crate) cfg: Config,
    pub(crate) seed: u64,
    /// Guards the effect of keyed requests (requests without a key cannot be deduped).
    pub(crate) store: MemoryStore<Receipt, Failure>,
    /// In a `--redis` worker: the shared store that guards the effect instead.
    pub(crate) redis: Option<RedisStore<Failure>>,
    /// In a `--redis` worker: receipts are unique per process (index in the top bits),
    /// and each applied effect is reported to the parent (`E order` on stdout).
    pub(crate) worker: Option<u32>,
    /// How often each intent's effect (the stock deduction) was applied.
    pub(crate) ledger: Vec<AtomicU32>,
    pub(crate) next_receipt: AtomicU64,
    pub(crate) failed_before: AtomicU64,
    pub(crate) throttled: AtomicU64,
    /// In a `--redis` worker: attempts the Redis store refused (e.g. unreachable).
    pub(crate) store_errors: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) answered: AtomicU64,
}

impl Service {
    pub(crate) fn new(cfg: &Config, seed: u64) -> Self {
        Service {
            cfg: cfg.clone(),
            seed,
            store: MemoryStore::new(),
            redis: None,
            worker: None,
            ledger: (0..cfg.clients).map(|_| AtomicU32::new(0)).collect(),
            next_receipt: AtomicU64::new(1),
            failed_before: AtomicU64::new(0),
            throttled: AtomicU64::new(0),
            store_errors: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            answered: AtomicU64::new(0),
        }
    }

    pub(crate) fn fault(&self, order: u32, attempt: u32) -> Fault {
        let h = splitmix64(
            splitmix64(self.seed).wrapping_add((u64::from(order) << 32) | u64::from(attempt)),
        );
        let u = (h >> 11) as f64 / (1u64 << 53) as f64; // uniform in [0, 1)
        let c = &self.cfg;
        if u < c.fail {
            Fault::FailBefore
        } else if u < c.fail + c.throttle {
            Fault::Throttle
        } else if u < c.fail + c.throttle + c.drop {
            Fault::DropResponse
        } else {
            Fault::None
        }
    }

    /// The RPC handler: "deduct `qty` of stock for order N".
    pub(crate) async fn deduct_stock(&self, req: Request) -> Result<Receipt, Failure> {
        let fault = self.fault(req.order, req.attempt);
        match fault {
            Fault::FailBefore => {
                bump(&self.failed_before);
                return Err(Failure::new(Code::Unavailable));
            }
            Fault::Throttle => {
                bump(&self.throttled);
                return Err(Failure::new(Code::ResourceExhausted)
                    .with_server_delay(ServerDelay::After(self.cfg.pushback)));
            }
            Fault::DropResponse | Fault::None => {}
        }
        let receipt = match &req.key {
            // No key: the service cannot tell a retry from a new order.
            None => self.apply(req.order).await?,
            // A key: run the effect at most once per (tenant, method, key).
            Some(key) => {
                let scoped = ScopedKey::new(TENANT, METHOD, key).map_err(|e| failure_of(&e))?;
                let fp = fingerprint(&(req.order, req.qty)).map_err(|e| failure_of(&e))?;
                match &self.redis {
                    None => {
                        self.store
                            .execute(&scoped, &fp, || self.apply(req.order))
                            .await
                            .map_err(|e| failure_of(&e))?
                            .value
                    }
                    // The same, shared by every process of the fleet; results are bytes.
                    Some(redis) => {
                        let bytes = redis
                            .execute(&scoped, &fp, || async {
                                Ok(self.apply(req.order).await?.to_be_bytes().to_vec())
                            })
                            .await
                            .map_err(|e| {
                                if let Some(se) = e.store_error() {
                                    // The first one per worker is shown, the rest counted.
                                    if self.store_errors.fetch_add(1, Ordering::Relaxed) == 0 {
                                        eprintln!("demo worker: the Redis store: {se}");
                                    }
                                }
                                failure_of(&e)
                            })?
                            .value;
                        let bytes: [u8; 8] =
                            bytes.try_into().map_err(|_| Failure::new(Code::DataLoss))?;
                        Receipt::from_be_bytes(bytes)
                    }
                }
            }
        };
        if fault == Fault::DropResponse {
            // Executed, but the connection drops before the answer gets out:
            // the client cannot know whether the effect happened.
            bump(&self.dropped);
            return Err(Failure::outcome_unknown());
        }
        bump(&self.answered);
        Ok(receipt)
    }

    /// The side effect itself: takes a moment, then is recorded in the ledger.
    pub(crate) async fn apply(&self, order: u32) -> Result<Receipt, Failure> {
        tokio::time::sleep(Duration::from_millis(1)).await;
        self.ledger[order as usize].fetch_add(1, Ordering::Relaxed);
        let n = self.next_receipt.fetch_add(1, Ordering::Relaxed);
        match self.worker {
            None => Ok(n),
            Some(w) => {
                // Before the answer, so the parent counts it even if the answer is lost.
                send_line(&format!("E {order}"));
                Ok((u64::from(w) << 40) | n)
            }
        }
    }
}

/// Where a client's requests go: the in-process service, or a `--redis` fleet of
/// worker processes.
#[derive(Clone)]
pub(crate) enum Target {
    Local(Arc<Service>),
    Fleet(Arc<Fleet>),
}

impl Target {
    pub(crate) async fn call(&self, req: Request) -> Result<Receipt, Failure> {
        match self {
            Target::Local(service) => service.deduct_stock(req).await,
            Target::Fleet(fleet) => fleet.call(req).await,
        }
    }
}
