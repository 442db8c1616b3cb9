//! Connection slots: at most `cap` connections served at once; a slot is held by its guard and
//! given back when the guard drops, whatever way the connection ends.

use std::sync::Arc;

use crate::sync::{AtomicUsize, Ordering};

#[derive(Debug)]
pub struct ConnectionSlots {
    cap: usize,
    open: AtomicUsize,
}

/// One held slot.
#[derive(Debug)]
pub struct Slot(Arc<ConnectionSlots>);

impl Drop for Slot {
    fn drop(&mut self) {
        // Every decrement has its guard's increment before it: never below zero.
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

impl ConnectionSlots {
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(ConnectionSlots { cap, open: AtomicUsize::new(0) })
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Connections served now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    /// A slot, or the number open when all `cap` are taken. The count never passes the cap, even
    /// for a moment (a refused connection is never counted).
    pub fn try_acquire(self: &Arc<Self>) -> std::result::Result<Slot, usize> {
        self.open
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < self.cap).then_some(n + 1))
            .map(|_| Slot(self.clone()))
    }
}
