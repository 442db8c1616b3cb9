//! The encrypted, mutually authenticated channel one capture travels over.
//!
//! Noise `NNpsk0_25519_AESGCM_SHA256` (the `snow` crate, `ring` for AES-GCM and SHA-256): both
//! sides bring fresh ephemeral keys, and the pre-shared key is the request's [`CaptureKey`],
//! derived from the shared token, the per-request secret the decode host generated (and sent to
//! vLLM with the prefill request), the capture id, the decoder weights' fingerprint the decode host
//! asked for and a digest of the prompt's token ids. So:
//! - a peer without the token (a fake prefill server) fails the handshake before a byte of cache
//!   is accepted, and a decode host without it is refused before a byte is sent;
//! - anyone with only the token cannot pull another client's capture: they lack its secret;
//! - a recorded stream cannot be replayed, for another request or the same one: every session's
//!   keys come from both sides' fresh ephemerals, and the server streams only after the client
//!   has sent a frame under the session keys (a replayed first message cannot);
//! - two captures that share an id and secret but differ in prompt or weights never match.
//!
//! On the wire, after a clear hello (`"PDBW" | version | 1 | u16 id length | capture id | u8 lane |
//! u8 lanes | u16 length | Noise message 1`, the clear part bound into the handshake as its
//! prologue; lanes: [`super::lanes`]) and the
//! server's clear answer (`"PDBW" | version | 2 (accept) or 3 (refuse) | u16 length | Noise
//! message 2 or a reason`, after any number of `"PDBW" | version | 4 (waiting) | u16 0` while the
//! capture has not started: unauthenticated, so they only keep the decode host's idle deadline
//! from firing, and its overall deadline still bounds the wait), everything is Noise transport messages (`u16 BE length |
//! ciphertext`, at most 65,535 bytes), and inside them the frames of [`super::frame`]: a frame
//! starts a message, longer frames continue over the next ones.

use std::io::{Read, Write};

use hkdf::Hkdf;
use sha2::{Digest, Sha256};

use super::frame::{encode_head, parse_head, FrameKind, FrameSink, FrameSource, FRAME_HEAD};
use super::lanes::Lane;
use super::limits::FrameLimits;
use super::{MAGIC, VERSION};
use crate::error::{CoreError, Result};

/// The Noise protocol name; part of the wire version.
pub const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_AESGCM_SHA256";
/// Noise's largest message, and its AEAD tag.
pub const MAX_RECORD: usize = 65535;
const TAG: usize = 16;
/// Plaintext per transport message.
pub const MAX_RECORD_PLAINTEXT: usize = MAX_RECORD - TAG;
/// Capture ids are short (`pdb-<request id>-<8 hex>`); anything longer is refused unread.
pub const MAX_REQUEST_ID: usize = 256;
/// Handshake messages of this pattern are 48 bytes (an ephemeral key and an empty payload's tag).
const MAX_HANDSHAKE_MESSAGE: usize = 256;
/// A refusal's reason, as much as is read of it.
const MAX_REASON: usize = 1024;
/// Output is written in batches of about this many bytes (and at every frame's end).
const WRITE_BATCH: usize = 1 << 18;

const HELLO: u8 = 1;
const ACCEPT: u8 = 2;
const REFUSE: u8 = 3;
const WAITING: u8 = 4;

fn params() -> snow::params::NoiseParams {
    NOISE_PARAMS.parse().expect("the protocol name is valid")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex32(field: &str, s: &str) -> Result<[u8; 32]> {
    let bytes = s.as_bytes();
    if bytes.len() != 64 {
        return Err(CoreError::config(field, format!("must be 64 hex digits (32 bytes), got {} characters", s.len())));
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
        out[i] = match (digit(pair[0]), digit(pair[1])) {
            (Some(h), Some(l)) => h << 4 | l,
            _ => return Err(CoreError::config(field, "must be hex digits")),
        };
    }
    Ok(out)
}

/// The per-request secret the decode host generates and sends to vLLM in `pd_capture`: only a
/// holder of it (and of the token) can pull the capture.
#[derive(Clone, PartialEq, Eq)]
pub struct CaptureSecret([u8; 32]);

impl CaptureSecret {
    pub fn generate() -> Result<Self> {
        let mut b = [0u8; 32];
        getrandom::fill(&mut b).map_err(|e| CoreError::wire(format!("no randomness for a capture secret: {e}")))?;
        Ok(CaptureSecret(b))
    }

    /// From its 64 hex digits, as `pd_capture.secret` carries it.
    pub fn from_hex(s: &str) -> Result<Self> {
        unhex32("secret", s).map(CaptureSecret)
    }

    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl std::fmt::Debug for CaptureSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CaptureSecret(..)")
    }
}

/// SHA-256 over the prompt's token ids (u32 LE) as the prefill engine runs them and the decode
/// host names its blocks by: a capture of another prompt never matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptDigest(pub [u8; 32]);

impl PromptDigest {
    pub fn of(token_ids: &[u32]) -> Self {
        let mut h = Sha256::new();
        h.update(b"pd-bridge prompt v1\0");
        h.update((token_ids.len() as u64).to_le_bytes());
        for t in token_ids {
            h.update(t.to_le_bytes());
        }
        PromptDigest(h.finalize().into())
    }

    pub fn from_hex(s: &str) -> Result<Self> {
        unhex32("prompt_digest", s).map(PromptDigest)
    }

    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

/// The Noise pre-shared key of one capture.
#[derive(Clone, PartialEq, Eq)]
pub struct CaptureKey([u8; 32]);

impl std::fmt::Debug for CaptureKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CaptureKey(..)")
    }
}

impl CaptureKey {
    pub(super) fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// HKDF-SHA256: the shared token is the input key, the per-request secret the salt, and the
    /// wire version, capture id, weights fingerprint and prompt digest (each length-prefixed)
    /// the info.
    pub fn derive(token: &[u8], secret: &CaptureSecret, request_id: &str, fingerprint: &str, prompt: &PromptDigest) -> Result<Self> {
        if token.is_empty() {
            return Err(CoreError::config("token", "the shared token must not be empty"));
        }
        let mut info = Vec::with_capacity(64 + request_id.len() + fingerprint.len());
        info.extend_from_slice(b"pd-bridge wire psk\0");
        info.push(VERSION);
        info.extend_from_slice(NOISE_PARAMS.as_bytes());
        for field in [request_id.as_bytes(), fingerprint.as_bytes(), &prompt.0] {
            info.extend_from_slice(&(field.len() as u32).to_le_bytes());
            info.extend_from_slice(field);
        }
        let mut key = [0u8; 32];
        Hkdf::<Sha256>::new(Some(&secret.0), token).expand(&info, &mut key).expect("32 bytes is a valid HKDF length");
        Ok(CaptureKey(key))
    }
}

/// What both sides bind into the handshake: everything the hello carried in the clear.
pub(super) fn prologue_for(request_id: &str) -> Vec<u8> {
    prologue(request_id, Lane::SINGLE)
}

fn prologue(request_id: &str, lane: Lane) -> Vec<u8> {
    let mut p = Vec::with_capacity(8 + request_id.len());
    p.extend_from_slice(MAGIC);
    p.push(VERSION);
    p.push(HELLO);
    p.extend_from_slice(&[lane.index, lane.count]);
    p.extend_from_slice(request_id.as_bytes());
    p
}

fn io(what: &str) -> impl Fn(std::io::Error) -> CoreError + '_ {
    move |e| CoreError::wire(format!("{what}: {e}"))
}

fn read_u16(r: &mut impl Read, what: &str) -> Result<usize> {
    let mut b = [0u8; 2];
    r.read_exact(&mut b).map_err(io(what))?;
    Ok(u16::from_le_bytes(b) as usize)
}

/// The clear `"PDBW" | version | kind` every handshake message starts with.
fn read_preamble(r: &mut impl Read, who: &str) -> Result<u8> {
    let mut p = [0u8; 6];
    r.read_exact(&mut p).map_err(io(&format!("{who} closed or failed before the handshake")))?;
    if &p[..4] != MAGIC {
        return Err(CoreError::wire(format!("{who} does not speak the pd-bridge wire (bad magic)")));
    }
    if p[4] != VERSION {
        return Err(CoreError::wire(format!("{who} speaks wire version {}, this build speaks {VERSION}: upgrade both hosts to the same pd-bridge", p[4])));
    }
    Ok(p[5])
}

/// Decode host: open the channel for `request_id` with its key, over a connected stream.
/// Fails with `CoreError::Auth` when the server does not prove the key.
pub fn connect<S: Read + Write>(stream: S, key: &CaptureKey, request_id: &str) -> Result<SecureChannel<S>> {
    connect_lane(stream, key, request_id, Lane::SINGLE)
}

/// Decode host: open one lane of a capture pulled over several ([`super::lanes`]).
pub fn connect_lane<S: Read + Write>(mut stream: S, key: &CaptureKey, request_id: &str, lane: Lane) -> Result<SecureChannel<S>> {
    if request_id.is_empty() || request_id.len() > MAX_REQUEST_ID {
        return Err(CoreError::config("request_id", format!("must be 1 to {MAX_REQUEST_ID} bytes")));
    }
    let lane = Lane::new(lane.index, lane.count)?;
    let mut hs = snow::Builder::new(params())
        .prologue(&prologue(request_id, lane))
        .and_then(|b| b.psk(0, &key.0))
        .and_then(|b| b.build_initiator())
        .map_err(|e| CoreError::wire(format!("handshake setup: {e}")))?;
    let mut msg = [0u8; MAX_HANDSHAKE_MESSAGE];
    let n = hs.write_message(&[], &mut msg).map_err(|e| CoreError::wire(format!("handshake: {e}")))?;
    let mut hello = Vec::with_capacity(12 + request_id.len() + n);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&[VERSION, HELLO]);
    hello.extend_from_slice(&(request_id.len() as u16).to_le_bytes());
    hello.extend_from_slice(request_id.as_bytes());
    hello.extend_from_slice(&[lane.index, lane.count]);
    hello.extend_from_slice(&(n as u16).to_le_bytes());
    hello.extend_from_slice(&msg[..n]);
    stream.write_all(&hello).and_then(|_| stream.flush()).map_err(io("sending the hello"))?;

    let (kind, len) = loop {
        let kind = read_preamble(&mut stream, "the prefill host")?;
        let len = read_u16(&mut stream, "reading the prefill host's answer")?;
        match (kind, len) {
            (WAITING, 0) => continue,
            (WAITING, n) => return Err(CoreError::wire(format!("a waiting notice must be empty, got {n} bytes"))),
            answer => break answer,
        }
    };
    match kind {
        ACCEPT if len <= MAX_HANDSHAKE_MESSAGE => {
            stream.read_exact(&mut msg[..len]).map_err(io("reading the prefill host's answer"))?;
            let mut payload = [0u8; MAX_HANDSHAKE_MESSAGE];
            hs.read_message(&msg[..len], &mut payload).map_err(|_| {
                CoreError::Auth("the prefill host failed the handshake: it does not hold the shared token, or its capture is for another request, prompt or weights; nothing was accepted".into())
            })?;
        }
        REFUSE => {
            let mut reason = vec![0u8; len.min(MAX_REASON)];
            stream.read_exact(&mut reason).map_err(io("reading the prefill host's refusal"))?;
            // Unauthenticated: reported, never trusted.
            return Err(CoreError::Auth(format!("the prefill host refused the stream: {}", String::from_utf8_lossy(&reason))));
        }
        other => return Err(CoreError::wire(format!("unexpected handshake answer (kind {other}, {len} bytes)"))),
    }
    let transport = hs.into_transport_mode().map_err(|e| CoreError::wire(format!("handshake: {e}")))?;
    let mut ch = SecureChannel::new(stream, transport);
    // Only a holder of this session's keys can send this: the server starts streaming on it, so
    // a replayed first handshake message (which would pass the PSK check) gets nothing.
    ch.send_frame(FrameKind::Pull, request_id.as_bytes())?;
    Ok(ch)
}

/// Prefill host: a client's clear hello, read and bounded before any key is known.
pub struct Hello {
    pub request_id: String,
    /// Which lane of the capture this connection asks for.
    pub lane: Lane,
    message: Vec<u8>,
}

impl std::fmt::Debug for Hello {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hello").field("request_id", &self.request_id).field("lane", &self.lane).finish_non_exhaustive()
    }
}

/// A hello whose first message the responder has read with one key.
pub struct Matched(snow::HandshakeState);

impl Hello {
    pub fn read(r: &mut impl Read) -> Result<Hello> {
        let kind = read_preamble(r, "the decode host")?;
        if kind != HELLO {
            return Err(CoreError::wire(format!("expected a hello, got handshake kind {kind}")));
        }
        let id_len = read_u16(r, "reading the hello")?;
        if id_len == 0 || id_len > MAX_REQUEST_ID {
            return Err(CoreError::wire(format!("capture id of {id_len} bytes (1 to {MAX_REQUEST_ID} allowed)")));
        }
        let mut id = vec![0u8; id_len];
        r.read_exact(&mut id).map_err(io("reading the hello"))?;
        let request_id = String::from_utf8(id).map_err(|_| CoreError::wire("capture id is not UTF-8"))?;
        let mut lane = [0u8; 2];
        r.read_exact(&mut lane).map_err(io("reading the hello"))?;
        let lane = Lane::new(lane[0], lane[1]).map_err(|e| CoreError::wire(format!("the hello's lane: {e}")))?;
        let len = read_u16(r, "reading the hello")?;
        if len > MAX_HANDSHAKE_MESSAGE {
            return Err(CoreError::wire(format!("handshake message of {len} bytes (at most {MAX_HANDSHAKE_MESSAGE})")));
        }
        let mut message = vec![0u8; len];
        r.read_exact(&mut message).map_err(io("reading the hello"))?;
        Ok(Hello { request_id, lane, message })
    }

    /// Whether the client used `key` (the first message decrypts and authenticates under it).
    pub fn try_key(&self, key: &CaptureKey) -> Option<Matched> {
        let mut hs = snow::Builder::new(params()).prologue(&prologue(&self.request_id, self.lane)).ok()?.psk(0, &key.0).ok()?.build_responder().ok()?;
        let mut payload = [0u8; MAX_HANDSHAKE_MESSAGE];
        hs.read_message(&self.message, &mut payload).ok().map(|_| Matched(hs))
    }
}

/// Prefill host: tell a client no, in the clear (it is not authenticated, so it says little).
pub fn refuse(w: &mut impl Write, reason: &str) {
    let reason = &reason.as_bytes()[..reason.len().min(MAX_REASON)];
    let mut out = Vec::with_capacity(8 + reason.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[VERSION, REFUSE]);
    out.extend_from_slice(&(reason.len() as u16).to_le_bytes());
    out.extend_from_slice(reason);
    let _ = w.write_all(&out).and_then(|_| w.flush());
}

/// Prefill host: tell a client whose capture has not started yet that this host is alive and
/// still waiting for it. False when the client can no longer be written to.
pub fn waiting(w: &mut impl Write) -> bool {
    let mut out = [0u8; 8];
    out[..4].copy_from_slice(MAGIC);
    out[4..6].copy_from_slice(&[VERSION, WAITING]);
    w.write_all(&out).and_then(|_| w.flush()).is_ok()
}

/// Prefill host: finish the handshake the client's hello matched, then read its pull frame
/// (which must name the same capture). Returns the channel to stream on.
pub fn accept<S: Read + Write>(mut stream: S, hello: &Hello, matched: Matched) -> Result<SecureChannel<S>> {
    let mut hs = matched.0;
    let mut msg = [0u8; MAX_HANDSHAKE_MESSAGE];
    let n = hs.write_message(&[], &mut msg).map_err(|e| CoreError::wire(format!("handshake: {e}")))?;
    let mut out = Vec::with_capacity(8 + n);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[VERSION, ACCEPT]);
    out.extend_from_slice(&(n as u16).to_le_bytes());
    out.extend_from_slice(&msg[..n]);
    stream.write_all(&out).and_then(|_| stream.flush()).map_err(io("answering the hello"))?;
    let transport = hs.into_transport_mode().map_err(|e| CoreError::wire(format!("handshake: {e}")))?;
    let mut ch = SecureChannel::new(stream, transport);
    let (kind, payload) = ch.next_frame(&FrameLimits::default()).map_err(|e| CoreError::Auth(format!("no pull under the session keys ({e}): a replayed or broken handshake")))?;
    if kind != FrameKind::Pull || payload != hello.request_id.as_bytes() {
        return Err(CoreError::wire(format!("expected a pull for {:?}, got a {kind:?} frame", hello.request_id)));
    }
    Ok(ch)
}

/// Bytes a frame with a `payload`-byte payload takes on the wire: its head and payload in
/// records of at most [`MAX_RECORD_PLAINTEXT`], each with a 2-byte length and a tag.
pub fn frame_wire_bytes(payload: u64) -> u64 {
    let plain = payload + FRAME_HEAD as u64;
    let records = plain.div_ceil(MAX_RECORD_PLAINTEXT as u64).max(1);
    plain + records * (2 + TAG as u64)
}

fn not_authentic() -> CoreError {
    CoreError::wire("a transport record failed authentication: the stream was altered, or is not from this session")
}

/// Frames inside Noise transport messages over `S`.
pub struct SecureChannel<S> {
    stream: S,
    transport: snow::TransportState,
    /// One ciphertext record as read, and its plaintext.
    record: Box<[u8]>,
    plain: Box<[u8]>,
    /// Records waiting to be written.
    out: Vec<u8>,
    /// The frame being read, reused from frame to frame.
    payload: Vec<u8>,
}

impl<S> SecureChannel<S> {
    fn new(stream: S, transport: snow::TransportState) -> Self {
        SecureChannel { stream, transport, record: vec![0u8; MAX_RECORD].into_boxed_slice(), plain: vec![0u8; MAX_RECORD].into_boxed_slice(), out: Vec::with_capacity(WRITE_BATCH + MAX_RECORD + 2), payload: Vec::new() }
    }

    pub fn get_ref(&self) -> &S {
        &self.stream
    }

    /// A channel on an already established session (the fuzz targets' in-memory sessions).
    pub(super) fn for_fuzzing(stream: S, transport: snow::TransportState) -> Self {
        Self::new(stream, transport)
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.stream
    }
}

impl<S: Write> SecureChannel<S> {
    /// Encrypt `plaintext` as one record at the end of the output batch.
    fn seal_record(&mut self, plaintext: &[u8]) -> Result<()> {
        let at = self.out.len();
        self.out.resize(at + 2 + plaintext.len() + TAG, 0);
        let n = self.transport.write_message(plaintext, &mut self.out[at + 2..]).map_err(|e| CoreError::wire(format!("encrypt: {e}")))?;
        self.out[at..at + 2].copy_from_slice(&(n as u16).to_be_bytes());
        self.out.truncate(at + 2 + n);
        Ok(())
    }

    /// One record of arbitrary plaintext, written at once (the fuzz targets' hostile sender).
    pub(super) fn record_for_fuzzing(&mut self, plaintext: &[u8]) -> Result<()> {
        self.seal_record(plaintext)?;
        self.write_out()
    }

    fn write_out(&mut self) -> Result<()> {
        let r = self.stream.write_all(&self.out);
        self.out.clear();
        r.map_err(io("send failed"))
    }
}

impl<S: Write> FrameSink for SecureChannel<S> {
    fn send_parts(&mut self, kind: FrameKind, parts: &[&[u8]]) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let head = encode_head(kind, len as u64);
        let mut plain = std::mem::take(&mut self.plain);
        let result = (|| -> Result<()> {
            // The first record: the head and what fits after it.
            plain[..FRAME_HEAD].copy_from_slice(&head);
            let mut fill = FRAME_HEAD;
            let (mut part, mut off) = (0usize, 0usize);
            let mut first = true;
            loop {
                // Whole records straight from a long part (no copy), once nothing is staged.
                if !first && fill == 0 {
                    while part < parts.len() && parts[part].len() - off >= MAX_RECORD_PLAINTEXT {
                        let p = parts[part];
                        self.seal_record(&p[off..off + MAX_RECORD_PLAINTEXT])?;
                        off += MAX_RECORD_PLAINTEXT;
                        if off == p.len() {
                            part += 1;
                            off = 0;
                        }
                        if self.out.len() >= WRITE_BATCH {
                            self.write_out()?;
                        }
                    }
                }
                // Stage up to a record from the parts.
                while fill < MAX_RECORD_PLAINTEXT && part < parts.len() {
                    let p = parts[part];
                    let n = (p.len() - off).min(MAX_RECORD_PLAINTEXT - fill);
                    plain[fill..fill + n].copy_from_slice(&p[off..off + n]);
                    fill += n;
                    off += n;
                    if off == p.len() {
                        part += 1;
                        off = 0;
                    }
                }
                if fill > 0 || first {
                    self.seal_record(&plain[..fill])?;
                    fill = 0;
                }
                first = false;
                if self.out.len() >= WRITE_BATCH {
                    self.write_out()?;
                }
                if part >= parts.len() {
                    break;
                }
            }
            self.write_out()?;
            self.stream.flush().map_err(io("send failed"))
        })();
        self.plain = plain;
        result
    }
}

impl<S: Read> SecureChannel<S> {
    /// One continuation record of a `len`-byte frame, decrypted in place at the payload's end.
    fn continue_frame(&mut self, payload: &mut Vec<u8>, kind: FrameKind, len: usize) -> Result<()> {
        let n = self.read_ciphertext(Some((kind, len as u64)))?;
        let left = len - payload.len();
        if n - TAG == 0 || n - TAG > left {
            return Err(CoreError::wire(format!("record of {} bytes where {left} of a {len}-byte {kind:?} frame remain", n - TAG)));
        }
        let at = payload.len();
        payload.resize(at + n, 0);
        let got = self.transport.read_message(&self.record[..n], &mut payload[at..]).map_err(|_| not_authentic());
        payload.truncate(at + got.as_ref().map_or(0, |g| *g));
        got.map(|_| ())
    }

    /// Read and decrypt one record into `self.plain`; returns its plaintext length.
    fn open_record(&mut self, inside: Option<(FrameKind, u64)>) -> Result<usize> {
        let n = self.read_ciphertext(inside)?;
        self.transport.read_message(&self.record[..n], &mut self.plain).map_err(|_| not_authentic())
    }

    /// Read one record's ciphertext into `self.record`; returns its length (at least a tag).
    fn read_ciphertext(&mut self, inside: Option<(FrameKind, u64)>) -> Result<usize> {
        let mut b = [0u8; 2];
        self.stream.read_exact(&mut b).map_err(|e| match inside {
            None => CoreError::wire(format!("stream ended or failed before a frame: {e}")),
            Some((k, len)) => CoreError::wire(format!("stream ended or failed inside a {len}-byte {k:?} frame: {e}")),
        })?;
        let n = u16::from_be_bytes(b) as usize;
        if n < TAG {
            return Err(CoreError::wire(format!("transport record of {n} bytes is shorter than its tag")));
        }
        self.stream.read_exact(&mut self.record[..n]).map_err(io("stream ended inside a transport record"))?;
        Ok(n)
    }
}

impl<S: Read> FrameSource for SecureChannel<S> {
    fn next_frame(&mut self, limits: &FrameLimits) -> Result<(FrameKind, &[u8])> {
        let n = self.open_record(None)?;
        if n < FRAME_HEAD {
            return Err(CoreError::wire(format!("record of {n} plaintext bytes cannot start a frame")));
        }
        let head: [u8; FRAME_HEAD] = self.plain[..FRAME_HEAD].try_into().expect("9 bytes");
        let (kind, len) = parse_head(&head, limits)?;
        let len = len as usize;
        let first = n - FRAME_HEAD;
        if first > len {
            return Err(CoreError::wire(format!("record carries {first} bytes of a {len}-byte {kind:?} frame")));
        }
        // Grows as records arrive, never from the declared length alone (a reused buffer keeps
        // the largest frame that actually arrived, at most the cap).
        let mut payload = std::mem::take(&mut self.payload);
        payload.clear();
        payload.extend_from_slice(&self.plain[FRAME_HEAD..n]);
        while payload.len() < len {
            // Continuation records decrypt in place at the payload's end (no staging copy): the
            // buffer grows by one record's ciphertext, never by more than arrived.
            let got = self.continue_frame(&mut payload, kind, len);
            if let Err(e) = got {
                self.payload = payload;
                return Err(e);
            }
        }
        self.payload = payload;
        Ok((kind, &self.payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derivation_binds_every_input() {
        let s = CaptureSecret::from_hex(&"ab".repeat(32)).unwrap();
        let s2 = CaptureSecret::from_hex(&"ac".repeat(32)).unwrap();
        let p = PromptDigest::of(&[1, 2, 3]);
        let k = CaptureKey::derive(b"tok", &s, "r", "fp", &p).unwrap();
        assert_eq!(k, CaptureKey::derive(b"tok", &s, "r", "fp", &p).unwrap());
        for other in [
            CaptureKey::derive(b"tok2", &s, "r", "fp", &p),
            CaptureKey::derive(b"tok", &s2, "r", "fp", &p),
            CaptureKey::derive(b"tok", &s, "r2", "fp", &p),
            CaptureKey::derive(b"tok", &s, "r", "fp2", &p),
            CaptureKey::derive(b"tok", &s, "r", "fp", &PromptDigest::of(&[1, 2, 4])),
        ] {
            assert_ne!(other.unwrap(), k);
        }
        assert!(CaptureKey::derive(b"", &s, "r", "fp", &p).is_err());
        assert_ne!(PromptDigest::of(&[1, 2]), PromptDigest::of(&[1, 2, 0]));
        assert!(CaptureSecret::from_hex("zz").is_err());
        assert!(CaptureSecret::from_hex(&"g0".repeat(32)).is_err());
        assert_eq!(CaptureSecret::from_hex(&s.to_hex()).unwrap(), s);
        assert_eq!(format!("{s:?}{k:?}"), "CaptureSecret(..)CaptureKey(..)");
    }
}
