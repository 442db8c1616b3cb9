//! The locks and counters the segment server shares between threads: std's, or shuttle's under
//! the `model-check` feature, so that `core/tests/outbox_model.rs` can drive the interleavings of
//! push, pull, close, evict, expire and seal instead of hoping for them.

#[cfg(not(feature = "model-check"))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(feature = "model-check"))]
pub(crate) use std::sync::{Condvar, Mutex, MutexGuard};

#[cfg(feature = "model-check")]
pub(crate) use shuttle::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
#[cfg(feature = "model-check")]
pub(crate) use shuttle::sync::{Condvar, Mutex, MutexGuard};

/// Lock, ignoring poison: every critical section leaves its state whole before anything that
/// could panic, so a panicked holder leaves nothing half-done.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Wait on `cv` for at most `timeout` (shuttle's never times out: its tests always wake).
pub(crate) fn wait_timeout<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>, timeout: std::time::Duration) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, timeout).map(|r| r.0).unwrap_or_else(|p| p.into_inner().0)
}
