//! The wire: how one capture's segments travel from the prefill host to the decode host.
//!
//! A connection is one capture: the decode host opens it, both sides prove the capture's key in a
//! Noise handshake ([`secure`]: mutual authentication, per-request keys, encryption), then the
//! prefill host sends the capture's segments in block order and exactly one seal, as frames
//! ([`frame`]) whose declared lengths are capped by what one block of the decoder's plan can hold
//! ([`limits`]) before anything is allocated.
//!
//! Version 4 (this one): Noise `NNpsk0_25519_AESGCM_SHA256`, its key from the token, the
//! per-request secret, the capture id, the weights fingerprint and the prompt digest; a capture
//! may be pulled over several streams ([`lanes`], the hello names the lane); the server says
//! "waiting" while a pull waits (from version 3). Any other version is refused by name, asking to
//! upgrade both hosts.

pub mod frame;
#[doc(hidden)]
pub mod fuzz;
pub mod lanes;
pub mod limits;
pub mod seal;
pub mod secure;

use crate::error::{CoreError, Result};
use crate::segment::Segment;

pub use frame::{FrameKind, FrameSink, FrameSource, PlainFrames};
pub use lanes::{Lane, LaneMerge, MAX_LANES};
pub use seal::Seal;
pub use limits::{max_segment_payload, FrameLimits};
pub use secure::{CaptureKey, CaptureSecret, PromptDigest, SecureChannel};

pub(crate) const MAGIC: &[u8; 4] = b"PDBW";
pub const VERSION: u8 = 4;

/// What the decode side reads from a stream, checked as it arrives.
pub enum Event {
    Segment(Segment),
    Seal(Seal),
}

/// Reads a request's segments, enforcing frame limits, request id, fingerprint and position
/// continuity.
pub struct SegmentReader<F> {
    inner: F,
    limits: FrameLimits,
    request_id: String,
    fingerprint: String,
    next_index: u32,
    next_start: u64,
    /// The lane this stream is ([`lanes`]): it carries every `lane.count`-th segment, so token
    /// positions follow on only across the lanes ([`LaneMerge`]).
    lane: Lane,
    sealed: bool,
}

impl<F: FrameSource> SegmentReader<F> {
    /// A reader with the limits of no particular plan (in-memory streams); the network reader
    /// uses [`Self::with_limits`] with the decoder's plan.
    pub fn new(inner: F, request_id: &str, fingerprint: &str) -> Self {
        Self::with_limits(inner, request_id, fingerprint, FrameLimits::default())
    }

    pub fn with_limits(inner: F, request_id: &str, fingerprint: &str, limits: FrameLimits) -> Self {
        SegmentReader { inner, limits, request_id: request_id.into(), fingerprint: fingerprint.into(), next_index: 0, next_start: 0, lane: Lane::SINGLE, sealed: false }
    }

    /// Expect the stream to start at segment `index`, token `start` (a capture resumed at a block
    /// boundary: the decoder holds the blocks before it).
    pub fn starting_at(mut self, index: u32, start: u64) -> Self {
        self.next_index = self.lane.first_from(index);
        self.next_start = start;
        self
    }

    /// Read one lane of a capture pulled over several ([`lanes`]); call before
    /// [`Self::starting_at`].
    pub fn on_lane(mut self, lane: Lane) -> Self {
        self.lane = lane;
        self.next_index = lane.first_from(self.next_index);
        self
    }

    pub fn get_ref(&self) -> &F {
        &self.inner
    }

    pub fn next_event(&mut self) -> Result<Event> {
        if self.sealed {
            return Err(CoreError::wire("the stream is already sealed"));
        }
        let (kind, payload) = loop {
            match self.inner.next_frame(&self.limits)? {
                (FrameKind::Waiting, []) => continue,
                (FrameKind::Waiting, p) => return Err(CoreError::wire(format!("a waiting frame must be empty, got {} bytes", p.len()))),
                frame => break frame,
            }
        };
        match kind {
            FrameKind::Segment => {
                let seg = Segment::decode(payload)?;
                let h = &seg.header;
                if h.request_id != self.request_id {
                    return Err(CoreError::wire(format!("segment for request {:?}, expected {:?}", h.request_id, self.request_id)));
                }
                if h.fingerprint != self.fingerprint {
                    return Err(CoreError::wire(format!("weights fingerprint {} does not match the decoder's {}", h.fingerprint, self.fingerprint)));
                }
                let single = self.lane.count == 1;
                if h.index != self.next_index || (single && h.start != self.next_start) {
                    return Err(CoreError::wire(format!("segment {} at token {} out of order: expected segment {} at token {}", h.index, h.start, self.next_index, self.next_start)));
                }
                self.next_index += self.lane.count as u32;
                self.next_start = h.end;
                Ok(Event::Segment(seg))
            }
            FrameKind::Seal => {
                let seal: Seal = serde_json::from_slice(payload).map_err(|e| CoreError::wire(format!("seal: {e}")))?;
                // Every segment this lane carries below the seal's count arrived, and no more.
                let blocks = seal.blocks();
                if self.lane.first_from(blocks) != self.next_index {
                    return Err(CoreError::wire(if self.lane.count == 1 {
                        format!("seal claims {blocks} blocks, {} arrived", self.next_index)
                    } else {
                        format!("seal claims {blocks} blocks, lane {} of {} stopped before segment {}", self.lane.index, self.lane.count, self.next_index)
                    }));
                }
                self.sealed = true;
                Ok(Event::Seal(seal))
            }
            FrameKind::Error => Err(CoreError::wire(format!("prefill host: {}", String::from_utf8_lossy(payload)))),
            other => Err(CoreError::wire(format!("unexpected {other:?} frame"))),
        }
    }
}

/// A segment frame's payload in two parts, without copying its body (`Segment::encode`'s
/// layout: u32 LE header length and header JSON, then the arrays as LE bf16, back to back).
fn segment_prefix(seg: &Segment) -> Vec<u8> {
    let header = serde_json::to_vec(&seg.header).expect("segment header serializes");
    let mut prefix = Vec::with_capacity(4 + header.len());
    prefix.extend_from_slice(&(header.len() as u32).to_le_bytes());
    prefix.extend_from_slice(&header);
    prefix
}

/// Bytes a segment takes on the wire inside its frame (payload only).
pub fn segment_payload_len(seg: &Segment) -> u64 {
    let header = serde_json::to_vec(&seg.header).map(|h| h.len()).unwrap_or(0);
    (4 + header + seg.body_bytes().len()) as u64
}

pub fn send_segment(w: &mut impl FrameSink, seg: &Segment) -> Result<()> {
    if cfg!(target_endian = "little") {
        // The body as it lies is the wire's bytes: records are encrypted straight from it.
        w.send_parts(FrameKind::Segment, &[&segment_prefix(seg), seg.body_bytes()])
    } else {
        w.send_frame(FrameKind::Segment, &seg.encode())
    }
}

pub fn send_seal(w: &mut impl FrameSink, seal: &Seal) -> Result<()> {
    w.send_frame(FrameKind::Seal, &serde_json::to_vec(seal).expect("seal serializes"))
}

/// No segment yet; the capture is still running.
pub fn send_waiting(w: &mut impl FrameSink) -> Result<()> {
    w.send_frame(FrameKind::Waiting, &[])
}

pub fn send_error(w: &mut impl FrameSink, message: &str) -> Result<()> {
    w.send_frame(FrameKind::Error, message.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::{ArrayView, LayerView};
    use half::bf16;

    fn seg(index: u32, start: u64, fp: &str) -> Segment {
        let d = vec![bf16::ONE; 6];
        Segment::from_views(crate::OmlxFormat::Fork070, "r", fp, index, start, start + 2, &[LayerView::Kv(ArrayView::new(3, &d), ArrayView::new(3, &d))])
    }

    #[test]
    fn parts_are_the_encoding() {
        let s = seg(0, 0, "fp");
        let mut buf = Vec::new();
        send_segment(&mut buf, &s).unwrap();
        assert_eq!(&buf[frame::FRAME_HEAD..], &s.encode()[..]);
        assert_eq!(segment_payload_len(&s), s.encode().len() as u64);
    }

    #[test]
    fn reader_enforces_order_fingerprint_and_limits() {
        let mut buf = Vec::new();
        send_segment(&mut buf, &seg(1, 2, "fp")).unwrap();
        assert!(SegmentReader::new(&buf[..], "r", "fp").next_event().err().unwrap().to_string().contains("out of order"));
        let mut buf = Vec::new();
        send_segment(&mut buf, &seg(0, 0, "other")).unwrap();
        assert!(SegmentReader::new(&buf[..], "r", "fp").next_event().err().unwrap().to_string().contains("fingerprint"));
        let mut buf = Vec::new();
        send_seal(&mut buf, &Seal::Complete { blocks: 3, tokens: 6 }).unwrap();
        assert!(SegmentReader::new(&buf[..], "r", "fp").next_event().err().unwrap().to_string().contains("claims 3 blocks"));
        let mut huge = Vec::new();
        huge.send_frame(FrameKind::Segment, b"").unwrap();
        huge[1..9].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(SegmentReader::new(&huge[..], "r", "fp").next_event().err().unwrap().to_string().contains("limit"));
        // A segment over the plan's cap is refused from its head alone.
        let mut buf = Vec::new();
        send_segment(&mut buf, &seg(0, 0, "fp")).unwrap();
        let small = FrameLimits { segment: 10, control: 10 };
        assert!(SegmentReader::with_limits(&buf[..], "r", "fp", small).next_event().err().unwrap().to_string().contains("10-byte limit"));
    }
}
