//! Fuzz targets for the wire's parsers, shared by the bounded property tests
//! (`core/tests/wire_fuzz.rs`, in `cargo test`) and the long run (`core/examples/fuzz_wire.rs`).
//! Each target takes arbitrary input, must never panic, and checks what must hold whatever the
//! input: a target panics only when such an invariant breaks (a finding).

use std::io::{Cursor, Read, Write};

use super::frame::{FrameSink, FrameSource};
use super::limits::FrameLimits;
use super::secure::{self, CaptureKey, CaptureSecret, Hello, PromptDigest, SecureChannel};
use super::{send_seal, send_segment, Event, Seal, SegmentReader};
use crate::segment::Segment;

/// Limits the targets read with: small enough that a case can declare far past them.
pub const LIMITS: FrameLimits = FrameLimits { segment: 1 << 20, control: 4096 };

fn key() -> CaptureKey {
    CaptureKey::derive(b"fuzz-token", &CaptureSecret::from_hex(&"ab".repeat(32)).expect("hex"), "r", "fp", &PromptDigest::of(&[1, 2, 3])).expect("key")
}

/// A connected pair of transport states (sender = prefill host, receiver = decode host), made in
/// memory with the wire's own handshake.
fn session() -> (snow::TransportState, snow::TransportState) {
    let k = key();
    let params: snow::params::NoiseParams = secure::NOISE_PARAMS.parse().expect("params");
    let pro = secure::prologue_for("r");
    let mut i = snow::Builder::new(params.clone()).prologue(&pro).and_then(|b| b.psk(0, k.as_bytes())).and_then(|b| b.build_initiator()).expect("initiator");
    let mut r = snow::Builder::new(params).prologue(&pro).and_then(|b| b.psk(0, k.as_bytes())).and_then(|b| b.build_responder()).expect("responder");
    let (mut a, mut b) = ([0u8; 256], [0u8; 256]);
    let n = i.write_message(&[], &mut a).expect("msg1");
    r.read_message(&a[..n], &mut b).expect("msg1 read");
    let n = r.write_message(&[], &mut a).expect("msg2");
    i.read_message(&a[..n], &mut b).expect("msg2 read");
    (r.into_transport_mode().expect("responder transport"), i.into_transport_mode().expect("initiator transport"))
}

struct Duplex {
    input: Cursor<Vec<u8>>,
    output: Vec<u8>,
}

impl Read for Duplex {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Duplex {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Read events until the first error or `max` events; every segment and seal the reader lets
/// through obeys the limits and the stream's order.
fn drain<F: FrameSource>(reader: &mut SegmentReader<F>, max: usize) -> Vec<Event> {
    let mut out = Vec::new();
    for _ in 0..max {
        match reader.next_event() {
            Ok(e) => {
                if let Event::Segment(s) = &e {
                    assert!(s.header.index as usize == out.len(), "segment {} accepted at position {}", s.header.index, out.len());
                    assert!(s.header.end > s.header.start);
                }
                let sealed = matches!(e, Event::Seal(_));
                out.push(e);
                if sealed {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    out
}

/// Plain frames (in-memory codec) from arbitrary bytes: no panic; nothing over the limits.
/// `n` small valid segments (one MLA-shaped layer of `width`, 4 tokens each): the seed stream
/// the fuzz targets mutate.
pub fn segments(n: usize, width: usize) -> Vec<Segment> {
    use crate::view::{ArrayView, LayerView};
    (0..n)
        .map(|i| {
            let d: Vec<half::bf16> = (0..4 * width).map(|j| half::bf16::from_f32((i * 31 + j) as f32)).collect();
            Segment::from_views(crate::OmlxFormat::Fork070, "r", "fp", i as u32, 4 * i as u64, 4 * i as u64 + 4, &[LayerView::Kv(ArrayView::new(width, &d), ArrayView::new(width, &d))])
        })
        .collect()
}

pub fn plain_frames(data: &[u8]) -> usize {
    let mut r = SegmentReader::with_limits(data, "r", "fp", LIMITS);
    drain(&mut r, 64).len()
}

/// The prefill host's hello parser on arbitrary bytes: no panic; a parsed hello is bounded, and
/// no key opens a hello that was not made with it.
pub fn hello(data: &[u8]) -> bool {
    match Hello::read(&mut &data[..]) {
        Ok(h) => {
            assert!(!h.request_id.is_empty() && h.request_id.len() <= secure::MAX_REQUEST_ID);
            assert!(h.try_key(&key()).is_none(), "a random hello opened under the fuzz key");
            true
        }
        Err(_) => false,
    }
}

/// The decode host's handshake on an arbitrary answer from a "prefill host": it must never
/// complete (random bytes cannot prove the key).
pub fn client_handshake(answer: &[u8]) -> bool {
    let mut d = Duplex { input: Cursor::new(answer.to_vec()), output: Vec::new() };
    assert!(secure::connect(&mut d, &key(), "r").is_err(), "a handshake completed against arbitrary bytes");
    false
}

/// Arbitrary bytes where the encrypted stream belongs: the reader must not accept a single event.
pub fn secure_garbage(data: &[u8]) -> usize {
    let (_, rx) = session();
    let mut r = SegmentReader::with_limits(SecureChannel::for_fuzzing(Cursor::new(data.to_vec()), rx), "r", "fp", LIMITS);
    let got = drain(&mut r, 16);
    assert!(got.is_empty(), "{} events accepted from unauthenticated bytes", got.len());
    0
}

/// An authenticated but hostile sender: each of `records` is sent as one transport record's
/// plaintext (arbitrary frame heads, lengths, kinds, splits). No panic; limits and order hold.
pub fn hostile_records(records: &[Vec<u8>]) -> usize {
    let (tx, rx) = session();
    let mut sender = SecureChannel::for_fuzzing(Vec::new(), tx);
    for r in records {
        let r = &r[..r.len().min(secure::MAX_RECORD_PLAINTEXT)];
        sender.record_for_fuzzing(r).expect("encrypt");
    }
    let bytes = std::mem::take(sender.get_mut());
    let mut reader = SegmentReader::with_limits(SecureChannel::for_fuzzing(Cursor::new(bytes), rx), "r", "fp", LIMITS);
    drain(&mut reader, 64).len()
}

/// A valid encrypted stream of `segments` (then a seal), with `mutate` applied to its bytes:
/// what the reader accepts is always a prefix of what was sent, byte for byte.
pub fn mutated_stream(segments: &[Segment], mutate: impl FnOnce(&mut Vec<u8>)) -> usize {
    let (tx, rx) = session();
    let mut sender = SecureChannel::for_fuzzing(Vec::new(), tx);
    for s in segments {
        send_segment(&mut sender, s).expect("send");
    }
    let seal = Seal::Complete { blocks: segments.len() as u32, tokens: segments.last().map_or(0, |s| s.header.end) };
    send_seal(&mut sender, &seal).expect("seal");
    let mut bytes = std::mem::take(sender.get_mut());
    let original = bytes.clone();
    mutate(&mut bytes);
    let mut reader = SegmentReader::with_limits(SecureChannel::for_fuzzing(Cursor::new(bytes.clone()), rx), "r", "fp", LIMITS);
    let got = drain(&mut reader, segments.len() + 2);
    for (i, e) in got.iter().enumerate() {
        match e {
            Event::Segment(s) => assert!(i < segments.len() && *s == segments[i], "event {i}: a segment that was not sent"),
            Event::Seal(s) => assert!(i == segments.len() && *s == seal, "event {i}: a seal that was not sent"),
        }
    }
    if bytes == original {
        assert_eq!(got.len(), segments.len() + 1, "the unmutated stream reads whole");
    }
    got.len()
}

/// A plain-frame stream of `segments` (the in-memory codec), mutated: no panic.
pub fn mutated_plain(segments: &[Segment], mutate: impl FnOnce(&mut Vec<u8>)) -> usize {
    let mut bytes = Vec::new();
    for s in segments {
        send_segment(&mut bytes, s).expect("send");
    }
    send_seal(&mut bytes, &Seal::Aborted { blocks: segments.len() as u32, reason: "x".into() }).expect("seal");
    bytes.send_frame(super::FrameKind::Error, b"e").expect("error");
    mutate(&mut bytes);
    plain_frames(&bytes)
}

/// For the wire benchmark: encrypt `segments` into memory, then read them back, on this thread;
/// returns (seconds to send, seconds to read).
#[doc(hidden)]
pub fn bench_in_memory(segments: &[Segment], limits: FrameLimits) -> (f64, f64) {
    let (tx, rx) = session();
    let mut sender = SecureChannel::for_fuzzing(Vec::new(), tx);
    let t = std::time::Instant::now();
    for s in segments {
        send_segment(&mut sender, s).expect("send");
    }
    send_seal(&mut sender, &Seal::Complete { blocks: segments.len() as u32, tokens: 0 }).expect("seal");
    let send = t.elapsed().as_secs_f64();
    let bytes = std::mem::take(sender.get_mut());
    let t = std::time::Instant::now();
    let mut r = SegmentReader::with_limits(SecureChannel::for_fuzzing(Cursor::new(bytes), rx), "bench", "sha256:bench", limits);
    let mut n = 0;
    while let Ok(Event::Segment(_)) = r.next_event() {
        n += 1;
    }
    assert_eq!(n, segments.len(), "the benchmark stream reads whole");
    (send, t.elapsed().as_secs_f64())
}

/// An authenticated sender that declares a `declared`-byte segment frame and then sends only
/// `sent` bytes of it (in full records) before the stream ends: what the reader says.
#[doc(hidden)]
pub fn trickled_frame(declared: u64, sent: usize, limits: FrameLimits) -> crate::error::CoreError {
    let (tx, rx) = session();
    let mut sender = SecureChannel::for_fuzzing(Vec::new(), tx);
    let mut first = vec![super::FrameKind::Segment as u8];
    first.extend_from_slice(&declared.to_le_bytes());
    sender.record_for_fuzzing(&first).expect("encrypt");
    let chunk = vec![0u8; secure::MAX_RECORD_PLAINTEXT];
    let mut left = sent;
    while left > 0 {
        let n = left.min(chunk.len());
        sender.record_for_fuzzing(&chunk[..n]).expect("encrypt");
        left -= n;
    }
    let bytes = std::mem::take(sender.get_mut());
    let mut ch = SecureChannel::for_fuzzing(Cursor::new(bytes), rx);
    match ch.next_frame(&limits) {
        Ok((_, p)) => panic!("a {declared}-byte frame of which {sent} bytes arrived was accepted ({} bytes)", p.len()),
        Err(e) => e,
    }
}
