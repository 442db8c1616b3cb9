//! One capture's segments on their way out, and the accounting of what it holds.

use std::collections::VecDeque;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::config::ServerConfig;
use super::memory::SegmentMemory;
use crate::segment::Segment;
use crate::sync::{lock, wait_timeout, Condvar, Mutex, MutexGuard};
use crate::wire::{self, CaptureKey, Lane, Seal};

/// The close reason of an outbox whose seal went out.
pub(crate) const SENT: &str = "sent";

#[derive(Default)]
pub(crate) struct OutboxState {
    queue: VecDeque<(Segment, u64)>,
    queued_bytes: u64,
    seal: Option<Seal>,
    sealed_at: Option<Instant>,
    /// A decode host proved the key and is reading.
    pub(crate) pulled: bool,
    /// Over how many lanes it pulls (set by the first lane's claim), which lanes are claimed,
    /// which have sent the seal, and when the first was claimed.
    lanes: u8,
    claimed: u32,
    lanes_sent: u32,
    first_claim: Option<Instant>,
    /// Why nothing more will be sent (the seal went out, the reader left, the outbox was dropped).
    pub(crate) closed: Option<String>,
}

/// Who makes room when the outboxes together hold more than the memory bound: the server's
/// outboxes ([`super::Outboxes`]). A trait, so that an outbox needs nothing of the registry it
/// sits in.
pub(crate) trait Evict: Send + Sync {
    /// Drop unpulled captures, oldest first, until under the bound.
    fn evict(&self);
}

/// One capture's segments on their way out.
pub struct Outbox {
    pub(crate) request_id: String,
    /// None: a capture nobody can pull (no secret): segments are counted and dropped.
    pub(crate) key: Option<CaptureKey>,
    pub(crate) created: Instant,
    /// The server-wide count this outbox's queue is part of (None when detached).
    memory: Option<Arc<SegmentMemory>>,
    /// The server's outboxes, to evict the oldest unpulled ones when memory runs over.
    outboxes: Option<Weak<dyn Evict>>,
    state: Mutex<OutboxState>,
    ready: Condvar,
}

impl Outbox {
    pub(crate) fn new(request_id: &str, key: CaptureKey, memory: Arc<SegmentMemory>, outboxes: Weak<dyn Evict>, created: Instant) -> Self {
        Outbox { request_id: request_id.into(), key: Some(key), created, memory: Some(memory), outboxes: Some(outboxes), state: Mutex::default(), ready: Condvar::new() }
    }

    /// An outbox no decode host can pull (a capture without a secret, for tests and digests):
    /// pushes are accepted and dropped.
    pub fn detached(request_id: &str) -> Arc<Self> {
        Arc::new(Outbox {
            request_id: request_id.into(),
            key: None,
            created: Instant::now(),
            memory: None,
            outboxes: None,
            state: Mutex::default(),
            ready: Condvar::new(),
        })
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, OutboxState> {
        lock(&self.state)
    }

    /// Queue a segment; false when the stream is closed (receiver gone, dropped, too far behind).
    ///
    /// One engine step may complete many blocks at once (a whole prompt in one step releases
    /// every block at its last layer), so what bounds a stream is bytes, not segments: past the
    /// server's memory bound the oldest unpulled captures are dropped first, and if the
    /// outboxes being read still hold more than the bound, this one, the stream growing, is
    /// given up (its decode host sees a broken stream and falls back).
    pub fn push(&self, seg: Segment) -> bool {
        let Some(memory) = &self.memory else { return true };
        let bytes = wire::segment_payload_len(&seg);
        let total = {
            let mut s = self.lock();
            if s.closed.is_some() || s.seal.is_some() {
                return false;
            }
            // Charged before the reader can see the segment (see `memory`).
            let total = memory.charge(bytes);
            s.queue.push_back((seg, bytes));
            s.queued_bytes += bytes;
            self.ready.notify_all();
            total
        };
        if total > memory.bound() {
            if let Some(outboxes) = self.outboxes.as_ref().and_then(Weak::upgrade) {
                outboxes.evict();
            }
            if memory.over() {
                // Still over (pulled streams hold it, or another push charged since the
                // eviction): this stream, the one growing, gives up, saying which case it is.
                let (mine, pulled) = {
                    let s = self.lock();
                    (s.queued_bytes, s.pulled)
                };
                self.close(if pulled {
                    format!(
                        "the decode host is not reading fast enough: {} MiB queued for it, the prefill host's segment memory bound ({} MiB) is full",
                        mine >> 20,
                        memory.bound() >> 20
                    )
                } else {
                    format!("dropped unpulled: nobody had pulled it and the prefill host's segment memory bound ({} MiB) is full", memory.bound() >> 20)
                });
            }
        }
        !self.is_closed()
    }

    pub fn seal(&self, seal: Seal) {
        let mut s = self.lock();
        if s.seal.is_none() {
            s.seal = Some(seal);
            s.sealed_at = Some(Instant::now());
        }
        self.ready.notify_all();
    }

    /// Whether nothing more will be sent.
    pub fn is_closed(&self) -> bool {
        self.lock().closed.is_some()
    }

    /// Why the stream stopped before its seal went out, if it did: the capture can stop
    /// computing and seal aborted with this reason. None while it is open or once it was sent.
    pub fn closed_reason(&self) -> Option<String> {
        self.lock().closed.clone().filter(|r| r != SENT)
    }

    /// Bytes queued, not yet sent.
    pub fn queued_bytes(&self) -> u64 {
        self.lock().queued_bytes
    }

    /// Stop the stream (the first reason stays) and give its queued bytes back.
    pub fn close(&self, reason: String) {
        let mut s = self.lock();
        if s.closed.is_none() {
            if reason != SENT {
                tracing::warn!(request_id = %self.request_id, reason = %reason, "segment stream dropped");
            }
            s.closed = Some(reason);
        }
        s.queue.clear();
        let freed = std::mem::take(&mut s.queued_bytes);
        if let Some(memory) = &self.memory {
            memory.credit(freed);
        }
        self.ready.notify_all();
    }

    /// Take the outbox for one reader of the whole stream; false when another already has it or
    /// it is closed.
    pub fn claim(&self) -> bool {
        self.claim_lane(Lane::SINGLE).is_ok()
    }

    /// Take one lane of the outbox ([`crate::wire::lanes`]); refused, saying why, when the lane
    /// is taken, the lane count differs from the other lanes', or the outbox is closed.
    pub fn claim_lane(&self, lane: Lane) -> std::result::Result<(), String> {
        let mut s = self.lock();
        if s.closed.is_some() {
            return Err("this capture was dropped or already sent".into());
        }
        if s.pulled && s.lanes != lane.count {
            return Err(format!("this capture is being pulled over {} lanes, not {}", s.lanes, lane.count));
        }
        if s.claimed & (1 << lane.index) != 0 {
            return Err(if lane.count == 1 { "this capture is already being pulled".into() } else { format!("lane {} of {} of this capture is already being pulled", lane.index, lane.count) });
        }
        if !s.pulled {
            s.pulled = true;
            s.lanes = lane.count;
            s.first_claim = Some(Instant::now());
        }
        s.claimed |= 1 << lane.index;
        Ok(())
    }

    /// Lanes claimed whose server has not yet sent the seal (or failed, which removes the outbox).
    pub(crate) fn lanes_serving(&self) -> u32 {
        let s = self.lock();
        s.claimed.count_ones() - (s.lanes_sent & s.claimed).count_ones()
    }

    /// A lane sent its seal; true when it was the last lane to (the whole capture went out).
    pub fn lane_sent(&self, lane: Lane) -> bool {
        let mut s = self.lock();
        s.lanes_sent |= 1 << lane.index;
        s.lanes_sent.count_ones() == s.lanes as u32
    }

    /// Next thing to send on the single stream: a segment, then the seal once the queue is
    /// empty; None when `idle` passes with nothing to send or the outbox was closed.
    pub fn next(&self, idle: Duration) -> Option<std::result::Result<Segment, Seal>> {
        self.next_on(Lane::SINGLE, idle)
    }

    /// Next thing to send on `lane`: the next segment it carries, then the seal once none of its
    /// segments is queued (the seal comes after the capture's last push).
    pub fn next_on(&self, lane: Lane, idle: Duration) -> Option<std::result::Result<Segment, Seal>> {
        let deadline = Instant::now() + idle;
        let mut s = self.lock();
        loop {
            if s.closed.is_some() {
                return None;
            }
            let mine = if lane.count == 1 { (!s.queue.is_empty()).then_some(0) } else { s.queue.iter().position(|(seg, _)| lane.carries(seg.header.index)) };
            if let Some((seg, bytes)) = mine.and_then(|i| s.queue.remove(i)) {
                s.queued_bytes -= bytes;
                if let Some(memory) = &self.memory {
                    memory.credit(bytes);
                }
                return Some(Ok(seg));
            }
            if let Some(seal) = &s.seal {
                return Some(Err(seal.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s = wait_timeout(&self.ready, s, deadline - now);
        }
    }

    /// Why this outbox should be dropped at `now`, if it should: nobody pulled it in time.
    pub(crate) fn expired(&self, config: &ServerConfig, now: Instant) -> Option<String> {
        let s = self.lock();
        if s.closed.is_some() {
            return None;
        }
        if s.pulled {
            // The decode host opens every lane at once: one that never came holds the rest.
            let claimed = s.claimed.count_ones();
            return match s.first_claim {
                Some(at) if claimed < s.lanes as u32 && now.saturating_duration_since(at) > config.handshake => {
                    Some(format!("only {claimed} of its {} lanes were pulled within {:?} of the first", s.lanes, config.handshake))
                }
                _ => None,
            };
        }
        if let Some(at) = s.sealed_at {
            if now.saturating_duration_since(at) > config.grace {
                return Some(format!("sealed but not pulled within the {:?} grace", config.grace));
            }
        }
        (now.saturating_duration_since(self.created) > config.pull_timeout).then(|| format!("not pulled within {:?} of its start", config.pull_timeout))
    }
}
