//! The decode host's side of the segment stream: pull one capture from the prefill host's
//! [`crate::segment_server`], verify every segment, rebuild its block and write it, block by
//! block. A broken stream keeps every block already written: each is whole and verified.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::block::{BlockWriter, Landed};
use crate::error::{CoreError, Result};
use crate::wire::secure;
use crate::wire::{CaptureKey, CaptureSecret, Event, FrameLimits, PromptDigest, Seal, SegmentReader};

/// What an ingest achieved.
#[derive(Debug)]
pub struct Ingested {
    /// Blocks written (and flushed) in chain order, before any failure.
    pub blocks: usize,
    /// The prefill host's seal, or why the stream broke.
    pub outcome: std::result::Result<Seal, CoreError>,
}

/// Lets another thread stop an [`ingest`]: the decode host gives up on a prefill (its HTTP request
/// failed, the client went away) without waiting for the stream to time out.
#[derive(Default)]
pub struct IngestControl {
    cancelled: AtomicBool,
    stream: Mutex<Option<TcpStream>>,
}

impl IngestControl {
    /// Stop the ingest: a blocked read returns at once; blocks already written stay (each is
    /// whole and verified); nothing more is written.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        if let Some(s) = self.stream.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    fn attach(&self, stream: &TcpStream) -> Result<()> {
        let clone = stream.try_clone().map_err(|e| CoreError::wire(e.to_string()))?;
        *self.stream.lock().unwrap_or_else(|p| p.into_inner()) = Some(clone);
        self.check()
    }

    fn check(&self) -> Result<()> {
        if self.is_cancelled() {
            return Err(CoreError::wire("cancelled by the decode host"));
        }
        Ok(())
    }
}

/// What the decode host pulls, and with what proof.
#[derive(Clone, Debug)]
pub struct Pull<'a> {
    /// The prefill host's segment server: every address its name resolved to, tried in order
    /// (a Mac's `gpu-box.local` often resolves to an IPv6 link-local address first while the
    /// server listens on IPv4 only).
    pub addrs: Vec<SocketAddr>,
    pub token: &'a [u8],
    /// The secret this decode host generated for the capture and sent with its prefill request.
    pub secret: &'a CaptureSecret,
    pub request_id: &'a str,
    /// The decoder weights' fingerprint every segment must carry.
    pub fingerprint: &'a str,
    /// The prompt's token ids as sent to the prefill engine (those the blocks are named by).
    pub prompt: PromptDigest,
    /// What one block of the decoder's plan can hold ([`FrameLimits::for_plan`]).
    pub limits: FrameLimits,
    /// Connect, handshake and idle deadline.
    pub timeout: Duration,
}

/// The first of `addrs` that accepts a connection within `timeout`, or an error naming each
/// address tried and why it failed.
fn connect_any(addrs: &[SocketAddr], timeout: Duration) -> Result<TcpStream> {
    let mut tried = vec![];
    for addr in addrs {
        match TcpStream::connect_timeout(addr, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => tried.push(format!("{addr}: {e}")),
        }
    }
    if tried.is_empty() {
        return Err(CoreError::wire("cannot reach the prefill host: no address to connect to"));
    }
    Err(CoreError::wire(format!("cannot reach the prefill host at {}", tried.join("; "))))
}

/// Decode side: receive the capture's segments, write each block with `writer` as it arrives
/// (flushed and validated once under its final name before `on_block` gets its [`Landed`]:
/// index, path, hash and the validator's verdict), and stop at the seal. A broken stream keeps
/// every block already written: each is whole and verified.
pub fn ingest(pull: &Pull<'_>, writer: &BlockWriter, control: &IngestControl, mut on_block: impl FnMut(&Landed)) -> Ingested {
    let mut blocks = 0usize;
    let outcome = (|| -> Result<Seal> {
        control.check()?;
        let key = CaptureKey::derive(pull.token, pull.secret, pull.request_id, pull.fingerprint, &pull.prompt)?;
        let stream = connect_any(&pull.addrs, pull.timeout)?;
        control.attach(&stream)?;
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(Some(pull.timeout)).and_then(|_| stream.set_write_timeout(Some(pull.timeout))).map_err(|e| CoreError::wire(e.to_string()))?;
        let cancelled = |e: CoreError| if control.is_cancelled() { CoreError::wire("cancelled by the decode host") } else { e };
        let idle = Idle { stream, deadline: pull.timeout };
        let channel = secure::connect(idle, &key, pull.request_id).map_err(cancelled)?;
        // A writer resumed at a block boundary expects the stream from there (else block 0).
        let first = writer.next_block();
        let mut reader = SegmentReader::with_limits(channel, pull.request_id, pull.fingerprint, pull.limits).starting_at(first as u32, (first * writer.block_size()) as u64);
        loop {
            match reader.next_event().map_err(cancelled)? {
                Event::Segment(seg) => {
                    control.check()?;
                    // The writer's one entry point: checked against the plan and the block grid
                    // before anything is written.
                    let written = writer.write_segment(&seg)?;
                    let index = seg.header.index as usize;
                    writer.flush()?;
                    let landed = writer.landed(index, written)?;
                    blocks += 1;
                    on_block(&landed);
                }
                Event::Seal(seal) => return Ok(seal),
            }
        }
    })();
    Ingested { blocks, outcome }
}

/// The pull's TCP stream, whose read timeouts say what they are: no byte from the prefill host
/// within the deadline (the OS says only "Resource temporarily unavailable").
struct Idle {
    stream: TcpStream,
    deadline: Duration,
}

impl Read for Idle {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.read(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                std::io::Error::new(std::io::ErrorKind::TimedOut, format!("the prefill host sent nothing for {:?} (the decode host's idle deadline)", self.deadline))
            }
            _ => e,
        })
    }
}

impl std::io::Write for Idle {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}
