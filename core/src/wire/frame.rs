//! Frames: `kind u8 | len u64 LE | payload`, the unit the wire carries. On the network they only
//! ever travel inside the encrypted channel ([`super::secure`]); [`FrameSink`] and [`FrameSource`]
//! for plain byte buffers serve in-memory streams (tests, tools).
//!
//! A reader checks the declared length against [`FrameLimits`] before anything is allocated,
//! and the payload buffer grows only as bytes arrive (at most [`GROW_STEP`] ahead), so a
//! header that declares a huge frame and then trickles costs what actually came.

use std::io::{Read, Write};

use super::limits::FrameLimits;
use crate::error::{CoreError, Result};

/// `kind u8 | len u64 LE`.
pub const FRAME_HEAD: usize = 9;

/// How far a payload buffer may run ahead of the bytes received.
pub const GROW_STEP: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// Decode host → prefill host, first frame after the handshake: "send me this capture".
    Pull = 1,
    Segment = 3,
    Seal = 4,
    Error = 5,
    /// Prefill host → decode host, empty: no segment yet, the capture is still running (so
    /// the decode host's idle deadline measures a silent host, not a busy engine).
    Waiting = 6,
}

impl FrameKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => FrameKind::Pull,
            3 => FrameKind::Segment,
            4 => FrameKind::Seal,
            5 => FrameKind::Error,
            6 => FrameKind::Waiting,
            _ => return None,
        })
    }

    /// The largest payload `limits` allow for this kind.
    pub fn limit(self, limits: &FrameLimits) -> u64 {
        match self {
            FrameKind::Segment => limits.segment,
            _ => limits.control,
        }
    }
}

/// Parse a frame head; the declared length is checked against `limits` here, before any read.
pub fn parse_head(head: &[u8; FRAME_HEAD], limits: &FrameLimits) -> Result<(FrameKind, u64)> {
    let kind = FrameKind::from_u8(head[0]).ok_or_else(|| CoreError::wire(format!("unknown frame kind {}", head[0])))?;
    let len = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes"));
    let cap = kind.limit(limits);
    if len > cap {
        return Err(CoreError::wire(format!("{kind:?} frame of {len} bytes exceeds the {cap}-byte limit for this stream")));
    }
    Ok((kind, len))
}

pub fn encode_head(kind: FrameKind, len: u64) -> [u8; FRAME_HEAD] {
    let mut head = [0u8; FRAME_HEAD];
    head[0] = kind as u8;
    head[1..].copy_from_slice(&len.to_le_bytes());
    head
}

/// Where frames go.
pub trait FrameSink {
    /// Send one frame whose payload is the concatenation of `parts` (no copy into one buffer).
    fn send_parts(&mut self, kind: FrameKind, parts: &[&[u8]]) -> Result<()>;

    fn send_frame(&mut self, kind: FrameKind, payload: &[u8]) -> Result<()> {
        self.send_parts(kind, &[payload])
    }
}

/// Where frames come from.
pub trait FrameSource {
    /// The next frame; its declared length is checked against `limits` before it is read. The
    /// payload is borrowed from the source's buffer, reused for the next frame (a stream of
    /// block-sized frames then costs one buffer, not a fresh allocation each).
    fn next_frame(&mut self, limits: &FrameLimits) -> Result<(FrameKind, &[u8])>;
}

/// Plain frames appended to a buffer (in memory only).
impl FrameSink for Vec<u8> {
    fn send_parts(&mut self, kind: FrameKind, parts: &[&[u8]]) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        self.extend_from_slice(&encode_head(kind, len as u64));
        for p in parts {
            self.extend_from_slice(p);
        }
        Ok(())
    }
}

/// Plain frames read from a byte slice, which advances past each frame (in memory only).
impl FrameSource for &[u8] {
    fn next_frame(&mut self, limits: &FrameLimits) -> Result<(FrameKind, &[u8])> {
        let head: [u8; FRAME_HEAD] = self.get(..FRAME_HEAD).and_then(|h| h.try_into().ok()).ok_or_else(|| CoreError::wire("stream ended before a frame header"))?;
        let (kind, len) = parse_head(&head, limits)?;
        let rest = &self[FRAME_HEAD..];
        if (rest.len() as u64) < len {
            return Err(CoreError::wire(format!("stream ended inside a {len}-byte {kind:?} frame ({} bytes left)", rest.len())));
        }
        let (payload, after) = rest.split_at(len as usize);
        *self = after;
        Ok((kind, payload))
    }
}

/// Plain frames over any reader (in memory only: the network is always the encrypted channel).
pub struct PlainFrames<R> {
    inner: R,
    payload: Vec<u8>,
}

impl<R> PlainFrames<R> {
    pub fn new(inner: R) -> Self {
        PlainFrames { inner, payload: Vec::new() }
    }
}

impl<R: Read> FrameSource for PlainFrames<R> {
    fn next_frame(&mut self, limits: &FrameLimits) -> Result<(FrameKind, &[u8])> {
        let mut head = [0u8; FRAME_HEAD];
        self.inner.read_exact(&mut head).map_err(|e| CoreError::wire(format!("stream ended before a frame header: {e}")))?;
        let (kind, len) = parse_head(&head, limits)?;
        let payload = &mut self.payload;
        payload.clear();
        let mut left = len as usize;
        while left > 0 {
            let n = left.min(GROW_STEP);
            let at = payload.len();
            payload.resize(at + n, 0);
            self.inner.read_exact(&mut payload[at..]).map_err(|e| CoreError::wire(format!("stream ended inside a {len}-byte {kind:?} frame: {e}")))?;
            left -= n;
        }
        Ok((kind, payload))
    }
}

impl<W: Write> FrameSink for PlainFrames<W> {
    fn send_parts(&mut self, kind: FrameKind, parts: &[&[u8]]) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let w = &mut self.inner;
        let mut go = || -> std::io::Result<()> {
            w.write_all(&encode_head(kind, len as u64))?;
            for p in parts {
                w.write_all(p)?;
            }
            w.flush()
        };
        go().map_err(|e| CoreError::wire(format!("send failed: {e}")))
    }
}
