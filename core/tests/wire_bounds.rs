//! Allocation before trust: a frame header declaring 8 GiB, then a trickle of bytes, costs the
//! reader what actually arrived (measured with a counting allocator), and ends with a clear
//! error; under the plan's cap the same header is refused before a byte of payload is read.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Read;
use std::sync::atomic::{AtomicIsize, Ordering};

use pd_bridge_core::wire::{fuzz, FrameKind, FrameLimits, FrameSource, PlainFrames};

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size() as isize, Ordering::SeqCst) + l.size() as isize;
            PEAK.fetch_max(now, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size() as isize, Ordering::SeqCst);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Peak bytes allocated above the level at entry while `f` runs.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, isize) {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let out = f();
    (out, PEAK.load(Ordering::SeqCst) - base)
}

/// A peer that sends a frame head, then `body` bytes a few KiB at a time, then hangs up.
struct Trickle {
    head: Vec<u8>,
    body: usize,
    sent: usize,
}

impl Read for Trickle {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.sent < self.head.len() {
            let n = (self.head.len() - self.sent).min(buf.len());
            buf[..n].copy_from_slice(&self.head[self.sent..self.sent + n]);
            self.sent += n;
            return Ok(n);
        }
        let done = self.sent - self.head.len();
        let n = (self.body - done).min(buf.len()).min(4096);
        buf[..n].fill(0);
        self.sent += n;
        Ok(n)
    }
}

const EIGHT_GIB: u64 = 8 << 30;
const SENT: usize = 3 << 20;

// One test: the allocator's counters are process-wide.
#[test]
fn a_declared_8_gib_frame_costs_what_arrived() {
    let lax = FrameLimits { segment: 16 << 30, ..FrameLimits::default() };
    let mut head = vec![FrameKind::Segment as u8];
    head.extend_from_slice(&EIGHT_GIB.to_le_bytes());

    // The in-memory codec, with a cap above the declared length: the buffer follows the bytes.
    let (err, peak) = peak_during(|| PlainFrames::new(Trickle { head: head.clone(), body: SENT, sent: 0 }).next_frame(&lax).map(|_| ()).unwrap_err());
    assert!(err.to_string().contains("ended inside a 8589934592-byte Segment frame"), "{err}");
    assert!(peak < 3 * SENT as isize, "{peak} bytes held for {SENT} received");

    // The encrypted channel, from a peer that proved the key: the same.
    let (err, peak) = peak_during(|| fuzz::trickled_frame(EIGHT_GIB, SENT, lax));
    assert!(err.to_string().contains("inside a 8589934592-byte Segment frame"), "{err}");
    // The sender's records (about SENT bytes) are built in this thread too.
    assert!(peak < 5 * SENT as isize, "{peak} bytes held for {SENT} received");

    // Under a plan's cap the header alone is refused, before any payload is read or allocated.
    let plan_cap = FrameLimits { segment: 32 << 20, ..FrameLimits::default() };
    let (err, peak) = peak_during(|| PlainFrames::new(Trickle { head: head.clone(), body: SENT, sent: 0 }).next_frame(&plan_cap).map(|_| ()).unwrap_err());
    assert!(err.to_string().contains("exceeds the 33554432-byte limit"), "{err}");
    assert!(peak < 64 << 10, "{peak} bytes allocated to refuse a header");
    let err = fuzz::trickled_frame(EIGHT_GIB, 0, plan_cap);
    assert!(err.to_string().contains("exceeds the 33554432-byte limit"), "{err}");
}
