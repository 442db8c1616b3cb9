//! The wire: how segments travel from the prefill host to the decode host over one TCP stream.
//!
//! Every frame is `"PDBW" | version u8 | kind u8 | 0u16 | crc32(payload) u32 | len u64 | payload`.
//! A connection opens with a challenge-response on the shared token (HMAC-SHA256 over the
//! server's random nonce and the request id; the token itself never crosses the wire), then
//! carries the request's segments in block order and ends with exactly one seal.

use std::io::{Read, Write};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::{CoreError, Result};
use crate::segment::Segment;

const MAGIC: &[u8; 4] = b"PDBW";
pub const VERSION: u8 = 1;
/// The largest frame a peer may announce; anything larger is refused before allocating.
pub const MAX_PAYLOAD: u64 = 8 << 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Challenge = 1,
    Hello = 2,
    Segment = 3,
    Seal = 4,
    Error = 5,
}

impl FrameKind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => FrameKind::Challenge,
            2 => FrameKind::Hello,
            3 => FrameKind::Segment,
            4 => FrameKind::Seal,
            5 => FrameKind::Error,
            _ => return None,
        })
    }
}

pub fn write_frame(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> Result<()> {
    let mut head = [0u8; 20];
    head[..4].copy_from_slice(MAGIC);
    head[4] = VERSION;
    head[5] = kind as u8;
    head[8..12].copy_from_slice(&crc32fast::hash(payload).to_le_bytes());
    head[12..20].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    w.write_all(&head).and_then(|_| w.write_all(payload)).and_then(|_| w.flush()).map_err(|e| CoreError::wire(format!("send failed: {e}")))
}

pub fn read_frame(r: &mut impl Read) -> Result<(FrameKind, Vec<u8>)> {
    let mut head = [0u8; 20];
    r.read_exact(&mut head).map_err(|e| CoreError::wire(format!("connection closed or failed before a frame header: {e}")))?;
    if &head[..4] != MAGIC {
        return Err(CoreError::wire("not a pd-bridge stream (bad magic)"));
    }
    if head[4] != VERSION {
        return Err(CoreError::wire(format!("wire version {} is not supported (this build speaks {VERSION})", head[4])));
    }
    let kind = FrameKind::from_u8(head[5]).ok_or_else(|| CoreError::wire(format!("unknown frame kind {}", head[5])))?;
    let crc = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
    let len = u64::from_le_bytes(head[12..20].try_into().expect("8 bytes"));
    if len > MAX_PAYLOAD {
        return Err(CoreError::wire(format!("frame of {len} bytes exceeds the {MAX_PAYLOAD}-byte limit")));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).map_err(|e| CoreError::wire(format!("stream ended inside a {len}-byte frame: {e}")))?;
    if crc32fast::hash(&payload) != crc {
        return Err(CoreError::wire("frame checksum mismatch"));
    }
    Ok((kind, payload))
}

fn mac(token: &[u8], nonce: &[u8], request_id: &str) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(token).expect("HMAC takes keys of any length");
    m.update(nonce);
    m.update(request_id.as_bytes());
    m
}

#[derive(Serialize, Deserialize)]
struct Hello {
    request_id: String,
    mac: String,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (s.len() % 2 == 0).then(|| (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect::<Option<Vec<u8>>>()).flatten()
}

/// Prefill side: challenge the client, check its answer; returns the request id it asks for.
/// A wrong token gets an error frame and `CoreError::Auth`.
pub fn accept(stream: &mut (impl Read + Write), token: &[u8]) -> Result<String> {
    let mut nonce = [0u8; 32];
    getrandom::fill(&mut nonce).map_err(|e| CoreError::wire(format!("no randomness for the challenge: {e}")))?;
    write_frame(stream, FrameKind::Challenge, &nonce)?;
    let (kind, payload) = read_frame(stream)?;
    if kind != FrameKind::Hello {
        return Err(CoreError::wire(format!("expected a hello, got {kind:?}")));
    }
    let hello: Hello = serde_json::from_slice(&payload).map_err(|e| CoreError::wire(format!("hello: {e}")))?;
    let ok = unhex(&hello.mac).is_some_and(|m| mac(token, &nonce, &hello.request_id).verify_slice(&m).is_ok());
    if !ok {
        let _ = write_frame(stream, FrameKind::Error, b"unauthorized: the shared token does not match");
        return Err(CoreError::Auth(format!("client asked for {:?} with a wrong token", hello.request_id)));
    }
    Ok(hello.request_id)
}

/// Decode side: answer the server's challenge for `request_id`.
pub fn connect(stream: &mut (impl Read + Write), token: &[u8], request_id: &str) -> Result<()> {
    let (kind, nonce) = read_frame(stream)?;
    if kind != FrameKind::Challenge || nonce.len() != 32 {
        return Err(CoreError::wire(format!("expected a 32-byte challenge, got {kind:?} of {} bytes", nonce.len())));
    }
    let m = mac(token, &nonce, request_id).finalize().into_bytes();
    let hello = serde_json::to_vec(&Hello { request_id: request_id.into(), mac: hex(&m) }).expect("hello serializes");
    write_frame(stream, FrameKind::Hello, &hello)
}

/// How a capture ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Seal {
    /// Every full block of the prompt was sent.
    Complete { blocks: u32, tokens: u64 },
    /// Only a prefix was sent (still valid); `reason` says why.
    Partial { blocks: u32, tokens: u64, reason: String },
    /// The request was aborted or failed on the prefill host; `blocks` sent before it.
    Aborted { blocks: u32, reason: String },
}

/// What the decode side reads from a stream, checked as it arrives.
pub enum Event {
    Segment(Segment),
    Seal(Seal),
}

/// Reads a request's segments, enforcing request id, fingerprint and position continuity.
pub struct SegmentReader<R> {
    inner: R,
    request_id: String,
    fingerprint: String,
    next_index: u32,
    next_start: u64,
    sealed: bool,
}

impl<R: Read> SegmentReader<R> {
    pub fn new(inner: R, request_id: &str, fingerprint: &str) -> Self {
        SegmentReader { inner, request_id: request_id.into(), fingerprint: fingerprint.into(), next_index: 0, next_start: 0, sealed: false }
    }

    pub fn next_event(&mut self) -> Result<Event> {
        if self.sealed {
            return Err(CoreError::wire("the stream is already sealed"));
        }
        let (kind, payload) = read_frame(&mut self.inner)?;
        match kind {
            FrameKind::Segment => {
                let seg = Segment::decode(&payload)?;
                let h = &seg.header;
                if h.request_id != self.request_id {
                    return Err(CoreError::wire(format!("segment for request {:?}, expected {:?}", h.request_id, self.request_id)));
                }
                if h.fingerprint != self.fingerprint {
                    return Err(CoreError::wire(format!("weights fingerprint {} does not match the decoder's {}", h.fingerprint, self.fingerprint)));
                }
                if h.index != self.next_index || h.start != self.next_start {
                    return Err(CoreError::wire(format!("segment {} at token {} out of order: expected segment {} at token {}", h.index, h.start, self.next_index, self.next_start)));
                }
                self.next_index += 1;
                self.next_start = h.end;
                Ok(Event::Segment(seg))
            }
            FrameKind::Seal => {
                let seal: Seal = serde_json::from_slice(&payload).map_err(|e| CoreError::wire(format!("seal: {e}")))?;
                let blocks = match &seal {
                    Seal::Complete { blocks, .. } | Seal::Partial { blocks, .. } | Seal::Aborted { blocks, .. } => *blocks,
                };
                if blocks != self.next_index {
                    return Err(CoreError::wire(format!("seal claims {blocks} blocks, {} arrived", self.next_index)));
                }
                self.sealed = true;
                Ok(Event::Seal(seal))
            }
            FrameKind::Error => Err(CoreError::wire(format!("prefill host: {}", String::from_utf8_lossy(&payload)))),
            other => Err(CoreError::wire(format!("unexpected {other:?} frame"))),
        }
    }
}

pub fn send_segment(w: &mut impl Write, seg: &Segment) -> Result<()> {
    write_frame(w, FrameKind::Segment, &seg.encode())
}

pub fn send_seal(w: &mut impl Write, seal: &Seal) -> Result<()> {
    write_frame(w, FrameKind::Seal, &serde_json::to_vec(seal).expect("seal serializes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::layout::LayerView;
    use crate::pooler::ArrayView;
    use half::bf16;
    use std::net::{TcpListener, TcpStream};

    fn seg(index: u32, start: u64, fp: &str) -> Segment {
        let d = vec![bf16::ONE; 6];
        Segment::from_views(crate::OmlxFormat::Fork070, "r", fp, index, start, start + 2, &[LayerView::Kv(ArrayView::new(3, &d), ArrayView::new(3, &d))])
    }

    #[test]
    fn authenticated_stream_over_tcp() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let rid = accept(&mut s, b"secret").unwrap();
            send_segment(&mut s, &seg(0, 0, "fp")).unwrap();
            send_segment(&mut s, &seg(1, 2, "fp")).unwrap();
            send_seal(&mut s, &Seal::Complete { blocks: 2, tokens: 4 }).unwrap();
            rid
        });
        let mut c = TcpStream::connect(addr).unwrap();
        connect(&mut c, b"secret", "r").unwrap();
        let mut r = SegmentReader::new(c, "r", "fp");
        assert!(matches!(r.next_event().unwrap(), Event::Segment(_)));
        assert!(matches!(r.next_event().unwrap(), Event::Segment(_)));
        assert_eq!(match r.next_event().unwrap() { Event::Seal(s) => s, _ => panic!() }, Seal::Complete { blocks: 2, tokens: 4 });
        assert_eq!(server.join().unwrap(), "r");
    }

    #[test]
    fn wrong_token_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            accept(&mut s, b"secret")
        });
        let mut c = TcpStream::connect(addr).unwrap();
        connect(&mut c, b"guess", "r").unwrap();
        assert!(matches!(server.join().unwrap(), Err(CoreError::Auth(_))));
        let err = SegmentReader::new(c, "r", "fp").next_event().err().unwrap().to_string();
        assert!(err.contains("unauthorized"), "{err}");
    }

    #[test]
    fn reader_enforces_order_fingerprint_and_integrity() {
        let mut buf = Vec::new();
        send_segment(&mut buf, &seg(1, 2, "fp")).unwrap();
        assert!(SegmentReader::new(&buf[..], "r", "fp").next_event().err().unwrap().to_string().contains("out of order"));
        let mut buf = Vec::new();
        send_segment(&mut buf, &seg(0, 0, "other")).unwrap();
        assert!(SegmentReader::new(&buf[..], "r", "fp").next_event().err().unwrap().to_string().contains("fingerprint"));
        let mut buf = Vec::new();
        send_segment(&mut buf, &seg(0, 0, "fp")).unwrap();
        let n = buf.len();
        buf[n - 1] ^= 1;
        assert!(SegmentReader::new(&buf[..], "r", "fp").next_event().err().unwrap().to_string().contains("checksum"));
        let mut buf = Vec::new();
        send_seal(&mut buf, &Seal::Complete { blocks: 3, tokens: 6 }).unwrap();
        assert!(SegmentReader::new(&buf[..], "r", "fp").next_event().err().unwrap().to_string().contains("claims 3 blocks"));
        let mut huge = Vec::new();
        write_frame(&mut huge, FrameKind::Segment, b"").unwrap();
        huge[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(SegmentReader::new(&huge[..], "r", "fp").next_event().err().unwrap().to_string().contains("limit"));
    }
}
