//! The server's outboxes by capture id: registering, finding one for a pull, and dropping those
//! nobody will read (evicted past the memory bound, expired past their grace or pull timeout).
//! Transport-free: the TCP side ([`super::SegmentServer`]) and the model check drive it alike.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::config::ServerConfig;
use super::memory::SegmentMemory;
use super::outbox::{Evict, Outbox};
use crate::sync::{lock, wait_timeout, AtomicBool, Condvar, Mutex, MutexGuard, Ordering};
use crate::wire::secure::{Hello, Matched};
use crate::wire::CaptureKey;

pub struct Outboxes {
    pub(crate) config: ServerConfig,
    memory: Arc<SegmentMemory>,
    registry: Mutex<HashMap<String, Vec<Arc<Outbox>>>>,
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

    fn registry(&self) -> MutexGuard<'_, HashMap<String, Vec<Arc<Outbox>>>> {
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
        reg.entry(request_id.to_string()).or_default().push(outbox.clone());
        self.registered.notify_all();
        outbox
    }

    /// Outboxes registered and not yet dropped.
    pub fn len(&self) -> usize {
        self.registry().values().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Over the memory bound: drop unpulled captures, oldest first, until under it.
    pub fn evict(&self) {
        let reg = self.registry();
        let mut unpulled: Vec<&Arc<Outbox>> = reg
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
        if let Some(list) = reg.get_mut(&outbox.request_id) {
            list.retain(|o| !Arc::ptr_eq(o, outbox));
            if list.is_empty() {
                reg.remove(&outbox.request_id);
            }
        }
    }

    /// Drop outboxes past their grace or pull timeout at `now`, and closed ones nobody serves.
    pub fn sweep(&self, now: Instant) {
        let mut reg = self.registry();
        for list in reg.values_mut() {
            for o in list.iter() {
                if let Some(why) = o.expired(&self.config, now) {
                    o.close(why);
                }
            }
            list.retain(|o| {
                let s = o.lock();
                s.closed.is_none() || s.pulled
            });
        }
        reg.retain(|_, l| !l.is_empty());
    }

    /// Stop: every outbox closed (their captures stop), pulls waiting for a capture refused.
    pub fn shut_down(&self) {
        let reg = self.registry();
        self.shutdown.store(true, Ordering::SeqCst);
        self.registered.notify_all();
        for o in reg.values().flatten() {
            o.close("the segment server stopped".into());
        }
    }

    pub fn is_shut_down(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst)
    }

    /// The open outbox of `hello`'s capture whose key the client used: waits up to `wait` for
    /// the capture to start (a decode host connects as it sends the prefill request); refuses at
    /// once when captures of that id exist and none matches.
    pub fn find(&self, hello: &Hello, wait: Duration) -> std::result::Result<(Arc<Outbox>, Matched), String> {
        let deadline = Instant::now() + wait;
        let mut reg = self.registry();
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return Err("the segment server is stopping".into());
            }
            if let Some(list) = reg.get(&hello.request_id) {
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
            let now = Instant::now();
            if now >= deadline {
                // A pull that comes before its capture starts (the decode host connects as it
                // sends the prefill request) waits this long at most.
                return Err(format!("unauthorized: no capture with this id for this key started within {wait:?}"));
            }
            reg = wait_timeout(&self.registered, reg, deadline - now);
        }
    }
}

impl Evict for Outboxes {
    fn evict(&self) {
        Outboxes::evict(self)
    }
}
