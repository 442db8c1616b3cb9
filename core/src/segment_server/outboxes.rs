//! The server's outboxes by capture id: registering, finding one for a pull, and dropping those
//! nobody will read (evicted past the memory bound, expired past their grace or pull timeout).
//! Transport-free: the TCP side ([`super::SegmentServer`]) and the model check drive it alike.
//!
//! A dropped capture leaves a tombstone (its id and why) for a while, so that a pull coming
//! after the drop is refused at once with the reason, not held until its wait runs out.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::config::ServerConfig;
use super::memory::SegmentMemory;
use super::outbox::{Evict, Outbox};
use crate::sync::{lock, wait_timeout, AtomicBool, Condvar, Mutex, MutexGuard, Ordering};
use crate::wire::secure::{Hello, Matched};
use crate::wire::CaptureKey;

/// Tombstones kept at most; the oldest go first.
pub const MAX_TOMBSTONES: usize = 4096;

/// The outboxes by capture id, and the tombstones of those dropped lately.
#[derive(Default)]
pub(crate) struct Registry {
    open: HashMap<String, Vec<Arc<Outbox>>>,
    dropped: HashMap<String, (Instant, String)>,
    dropped_order: VecDeque<(Instant, String)>,
}

impl Registry {
    /// Remember why `o` left, unless another outbox of its id is still here.
    fn bury(&mut self, o: &Outbox, now: Instant) {
        if self.open.get(&o.request_id).is_some_and(|l| !l.is_empty()) {
            return;
        }
        let why = match o.lock().closed.clone() {
            Some(r) if r == super::outbox::SENT => "it was already pulled to the end".to_string(),
            Some(r) => r,
            None => "it was dropped".to_string(),
        };
        self.dropped.insert(o.request_id.clone(), (now, why));
        self.dropped_order.push_back((now, o.request_id.clone()));
        while self.dropped_order.len() > MAX_TOMBSTONES {
            self.forget_oldest();
        }
    }

    fn forget_oldest(&mut self) {
        if let Some((at, id)) = self.dropped_order.pop_front() {
            // Only the entry this order slot made (a later burial of the same id is newer).
            if self.dropped.get(&id).is_some_and(|(t, _)| *t == at) {
                self.dropped.remove(&id);
            }
        }
    }

    /// Tombstones older than `keep` go.
    fn prune(&mut self, now: Instant, keep: Duration) {
        while self.dropped_order.front().is_some_and(|(at, _)| now.saturating_duration_since(*at) > keep) {
            self.forget_oldest();
        }
    }
}

pub struct Outboxes {
    pub(crate) config: ServerConfig,
    memory: Arc<SegmentMemory>,
    registry: Mutex<Registry>,
    registered: Condvar,
    shutdown: AtomicBool,
    me: Weak<Outboxes>,
}

impl Outboxes {
    pub fn new(config: ServerConfig) -> Arc<Self> {
        Arc::new_cyclic(|me| Outboxes {
            memory: Arc::new(SegmentMemory::new(config.memory_bound)),
            config,
            registry: Mutex::default(),
            registered: Condvar::new(),
            shutdown: AtomicBool::new(false),
            me: me.clone(),
        })
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        lock(&self.registry)
    }

    pub fn memory(&self) -> &SegmentMemory {
        &self.memory
    }

    /// A new capture's outbox, pullable with `key`.
    pub fn register(&self, request_id: &str, key: CaptureKey) -> Arc<Outbox> {
        let outbox = Arc::new(Outbox::new(request_id, key, self.memory.clone(), self.me.clone(), Instant::now()));
        let mut reg = self.registry();
        if self.shutdown.load(Ordering::SeqCst) {
            // Registered after the server stopped: closed at once, so the capture stops too.
            drop(reg);
            outbox.close("the segment server stopped".into());
            return outbox;
        }
        reg.dropped.remove(request_id);
        reg.open.entry(request_id.to_string()).or_default().push(outbox.clone());
        self.registered.notify_all();
        outbox
    }

    /// Outboxes registered and not yet dropped.
    pub fn len(&self) -> usize {
        self.registry().open.values().map(Vec::len).sum()
    }

    /// Tombstones held now (bounded by [`MAX_TOMBSTONES`]).
    pub fn tombstones(&self) -> usize {
        self.registry().dropped.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Over the memory bound: drop unpulled captures, oldest first, until under it.
    pub fn evict(&self) {
        let reg = self.registry();
        let mut unpulled: Vec<&Arc<Outbox>> = reg
            .open
            .values()
            .flatten()
            .filter(|o| {
                let s = o.lock();
                !s.pulled && s.closed.is_none()
            })
            .collect();
        unpulled.sort_by_key(|o| o.created);
        for o in unpulled {
            if !self.memory.over() {
                break;
            }
            o.close(format!(
                "dropped unpulled: the prefill host's segment memory bound ({} MiB) was exceeded and this was the oldest capture nobody had pulled",
                self.memory.bound() >> 20
            ));
        }
    }

    /// A finished pull's outbox leaves the registry.
    pub fn remove(&self, outbox: &Arc<Outbox>) {
        let mut reg = self.registry();
        if let Some(list) = reg.open.get_mut(&outbox.request_id) {
            let before = list.len();
            list.retain(|o| !Arc::ptr_eq(o, outbox));
            let gone = list.len() < before;
            if list.is_empty() {
                reg.open.remove(&outbox.request_id);
            }
            if gone {
                reg.bury(outbox, Instant::now());
            }
        }
    }

    /// Drop outboxes past their grace or pull timeout at `now`, and closed ones nobody serves.
    pub fn sweep(&self, now: Instant) {
        let mut reg = self.registry();
        let mut gone = vec![];
        for list in reg.open.values_mut() {
            for o in list.iter() {
                if let Some(why) = o.expired(&self.config, now) {
                    o.close(why);
                }
            }
            list.retain(|o| {
                // A closed outbox still being served leaves when its last lane's server removes
                // it; one whose serving lanes are all done (the others never came) goes now.
                let open = o.lock().closed.is_none();
                let keep = open || o.lanes_serving() > 0;
                if !keep {
                    gone.push(o.clone());
                }
                keep
            });
        }
        reg.open.retain(|_, l| !l.is_empty());
        for o in gone {
            reg.bury(&o, now);
        }
        reg.prune(now, self.config.pull_timeout + self.config.grace);
    }

    /// Stop: every outbox closed (their captures stop), pulls waiting for a capture refused.
    pub fn shut_down(&self) {
        let reg = self.registry();
        self.shutdown.store(true, Ordering::SeqCst);
        self.registered.notify_all();
        for o in reg.open.values().flatten() {
            o.close("the segment server stopped".into());
        }
    }

    pub fn is_shut_down(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    /// The open outbox of `hello`'s capture whose key the client used. A decode host connects
    /// as it sends the prefill request, so the capture may not have started: this waits up to
    /// `wait` for it (vLLM may queue the request behind others for minutes), calling
    /// `still_waiting` every `keepalive` meanwhile (outside the lock) — it tells the client the
    /// host is alive, and gives up early when it returns false. Refuses at once when captures of
    /// that id exist and none matches, and when the capture was already dropped (its tombstone
    /// says why).
    pub fn find(&self, hello: &Hello, wait: Duration, keepalive: Duration, mut still_waiting: impl FnMut() -> bool) -> std::result::Result<(Arc<Outbox>, Matched), String> {
        let deadline = Instant::now() + wait;
        let keepalive = keepalive.max(Duration::from_millis(10));
        let mut next_keepalive = Instant::now() + keepalive;
        let mut reg = self.registry();
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return Err("the segment server is stopping".into());
            }
            if let Some(list) = reg.open.get(&hello.request_id) {
                let open: Vec<&Arc<Outbox>> = list.iter().filter(|o| o.lock().closed.is_none()).collect();
                for o in &open {
                    if let Some(m) = o.key.as_ref().and_then(|k| hello.try_key(k)) {
                        return Ok(((*o).clone(), m));
                    }
                }
                if !open.is_empty() {
                    return Err("unauthorized: no capture with this id for this key".into());
                }
            }
            if let Some((_, why)) = reg.dropped.get(&hello.request_id) {
                return Err(format!("the capture {:?} is no longer here: {why}", hello.request_id));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!("unauthorized: no capture with this id for this key started within {wait:?}"));
            }
            if now >= next_keepalive {
                drop(reg);
                if !still_waiting() {
                    return Err("the decode host went away while its capture waited to start".into());
                }
                next_keepalive = Instant::now() + keepalive;
                reg = self.registry();
                continue;
            }
            reg = wait_timeout(&self.registered, reg, deadline.min(next_keepalive) - now);
        }
    }
}

impl Evict for Outboxes {
    fn evict(&self) {
        Outboxes::evict(self)
    }
}
