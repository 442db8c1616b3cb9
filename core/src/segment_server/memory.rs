//! The prefill host's segment memory: the bytes all outboxes hold together, against one bound.
//!
//! The count moves only under the lock of the outbox whose queue changes, in the same critical
//! section as the queue (charge as a segment becomes visible to its reader, credit as it leaves),
//! so at any moment no outbox lock is held, `used` is exactly the sum of the outboxes' queued
//! bytes. Before this, a push queued the segment and woke its reader under the lock and counted
//! the bytes after it: a reader that popped in between credited bytes never charged, the count
//! wrapped below zero, and every other capture's push saw "memory bound full" and closed itself.

use crate::sync::{AtomicU64, Ordering};

/// Bytes queued on the prefill host for every decode host together.
#[derive(Debug)]
pub struct SegmentMemory {
    bound: u64,
    used: AtomicU64,
    /// Credits of more than was charged: a broken invariant, counted (and fatal under the model
    /// check) rather than wrapped.
    faults: AtomicU64,
}

impl SegmentMemory {
    pub fn new(bound: u64) -> Self {
        SegmentMemory { bound, used: AtomicU64::new(0), faults: AtomicU64::new(0) }
    }

    pub fn bound(&self) -> u64 {
        self.bound
    }

    /// Bytes held now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }

    /// Whether more than the bound is held.
    pub fn over(&self) -> bool {
        self.used() > self.bound
    }

    /// How many credits found fewer bytes than they returned (0 unless the invariant broke).
    pub fn faults(&self) -> u64 {
        self.faults.load(Ordering::SeqCst)
    }

    /// Count bytes an outbox has just queued; the total held now. Called under that outbox's lock.
    pub(crate) fn charge(&self, bytes: u64) -> u64 {
        let before = self.used.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| Some(u.saturating_add(bytes))).unwrap_or_else(|u| u);
        before.saturating_add(bytes)
    }

    /// Return bytes an outbox no longer holds. Called under that outbox's lock.
    pub(crate) fn credit(&self, bytes: u64) {
        if self.used.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| u.checked_sub(bytes)).is_err() {
            self.faults.fetch_add(1, Ordering::SeqCst);
            #[cfg(feature = "model-check")]
            panic!("segment memory credited {bytes} bytes it was never charged");
            #[cfg(not(feature = "model-check"))]
            {
                tracing::error!(bytes, "segment memory credited more than it holds (a bug): count reset to zero");
                self.used.store(0, Ordering::SeqCst);
            }
        }
    }
}
