//! Streaming over TCP: the prefill host's segment server and the decode host's ingest.
//!
//! The server keeps an [`Outbox`] per request; the capture side pushes segments into it as they
//! complete and finally a seal. A decode host connects, authenticates for one request id and
//! receives that request's segments as they arrive — nothing is staged on disk, and a segment
//! leaves the prefill host's memory once it is sent. [`ingest`] is the decode side: it verifies
//! every segment, rebuilds the block and writes it, block by block.

use std::collections::{HashMap, VecDeque};
use std::io::BufWriter;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::assembler::Assembler;
use crate::block::BlockWriter;
use crate::error::{CoreError, Result};
use crate::segment::Segment;
use crate::wire::{self, Event, Seal, SegmentReader};

#[derive(Default)]
struct OutboxState {
    queue: VecDeque<Segment>,
    seal: Option<Seal>,
    /// The decode host went away; the capture may stop producing.
    closed: bool,
}

/// Segments an outbox holds for a decode host that is not reading; past this the request's
/// stream is given up (the decode host will see a broken stream and fall back) rather than
/// letting prefill-host memory grow with the prompt.
pub const MAX_QUEUED: usize = 64;

/// One request's segments on their way out.
#[derive(Default)]
pub struct Outbox {
    state: Mutex<OutboxState>,
    ready: Condvar,
}

impl Outbox {
    /// Queue a segment; false when the stream is closed (receiver gone, or too far behind).
    pub fn push(&self, seg: Segment) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.closed || s.seal.is_some() {
            return false;
        }
        if s.queue.len() >= MAX_QUEUED {
            tracing::warn!(request_id = %seg.header.request_id, queued = s.queue.len(), "decode host is not reading; dropping the segment stream");
            s.closed = true;
            s.queue.clear();
            self.ready.notify_all();
            return false;
        }
        s.queue.push_back(seg);
        self.ready.notify_all();
        true
    }

    pub fn seal(&self, seal: Seal) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.seal.get_or_insert(seal);
        self.ready.notify_all();
    }

    /// Whether the receiving side has gone (sent everything, or failed).
    pub fn is_closed(&self) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).closed
    }

    /// Next thing to send: a segment, then the seal once the queue is empty; None when the
    /// deadline passes or the stream was given up.
    fn next(&self, deadline: Instant) -> Option<std::result::Result<Segment, Seal>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if s.closed {
                return None;
            }
            if let Some(seg) = s.queue.pop_front() {
                return Some(Ok(seg));
            }
            if let Some(seal) = &s.seal {
                return Some(Err(seal.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s = self.ready.wait_timeout(s, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    fn close(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.closed = true;
        s.queue.clear();
    }
}

type Registry = Arc<Mutex<HashMap<String, Arc<Outbox>>>>;

/// The prefill host's segment server.
pub struct SegmentServer {
    addr: SocketAddr,
    outboxes: Registry,
}

impl SegmentServer {
    /// Listen on `addr`; connections must prove `token`. `idle` bounds how long a connection
    /// waits for the next segment before giving up on a silent capture.
    pub fn bind(addr: &str, token: Vec<u8>, idle: Duration) -> Result<Self> {
        if token.is_empty() {
            return Err(CoreError::config("token", "the shared token must not be empty"));
        }
        let listener = TcpListener::bind(addr).map_err(|e| CoreError::wire(format!("cannot listen on {addr}: {e}")))?;
        let local = listener.local_addr().map_err(|e| CoreError::wire(e.to_string()))?;
        let outboxes: Registry = Arc::default();
        let reg = outboxes.clone();
        let token = Arc::new(token);
        std::thread::Builder::new()
            .name("pd-bridge-segments".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    let Ok(stream) = conn else { continue };
                    let (reg, token) = (reg.clone(), token.clone());
                    let _ = std::thread::Builder::new().name("pd-bridge-send".into()).spawn(move || serve(stream, &token, &reg, idle));
                }
            })
            .map_err(|e| CoreError::wire(format!("cannot start the segment server: {e}")))?;
        Ok(SegmentServer { addr: local, outboxes })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The outbox of `request_id`, created on first use.
    pub fn outbox(&self, request_id: &str) -> Arc<Outbox> {
        self.outboxes.lock().unwrap_or_else(|p| p.into_inner()).entry(request_id.to_string()).or_default().clone()
    }
}

fn serve(mut stream: TcpStream, token: &[u8], reg: &Registry, idle: Duration) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let request_id = match wire::accept(&mut stream, token) {
        Ok(id) => id,
        Err(e) => {
            tracing::warn!(error = %e, "refused a segment stream");
            return;
        }
    };
    let outbox = reg.lock().unwrap_or_else(|p| p.into_inner()).entry(request_id.clone()).or_default().clone();
    let mut w = BufWriter::new(stream);
    let result = (|| -> Result<()> {
        loop {
            match outbox.next(Instant::now() + idle) {
                Some(Ok(seg)) => wire::send_segment(&mut w, &seg)?,
                Some(Err(seal)) => return wire::send_seal(&mut w, &seal),
                None => return Err(CoreError::wire(format!("no segment for {idle:?}"))),
            }
        }
    })();
    if let Err(e) = &result {
        tracing::warn!(request_id = %request_id, error = %e, "segment stream ended early");
    }
    outbox.close();
    reg.lock().unwrap_or_else(|p| p.into_inner()).remove(&request_id);
}

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
    cancelled: std::sync::atomic::AtomicBool,
    stream: Mutex<Option<TcpStream>>,
}

impl IngestControl {
    /// Stop the ingest: a blocked read returns at once; blocks already written stay (each is
    /// whole and verified); nothing more is written.
    pub fn cancel(&self) {
        self.cancelled.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(s) = self.stream.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(std::sync::atomic::Ordering::SeqCst)
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

/// Decode side: receive `request_id`'s segments from `addr`, write each block with `writer` as it
/// arrives (flushed before `on_block(index)` is called), and stop at the seal. A broken stream
/// keeps every block already written: each is whole and verified.
#[allow(clippy::too_many_arguments)]
pub fn ingest(addr: SocketAddr, token: &[u8], request_id: &str, fingerprint: &str, writer: &BlockWriter, timeout: Duration, control: &IngestControl, mut on_block: impl FnMut(usize)) -> Ingested {
    let mut blocks = 0usize;
    let outcome = (|| -> Result<Seal> {
        control.check()?;
        let mut stream = TcpStream::connect_timeout(&addr, timeout).map_err(|e| CoreError::wire(format!("cannot reach the prefill host at {addr}: {e}")))?;
        control.attach(&stream)?;
        stream.set_read_timeout(Some(timeout)).map_err(|e| CoreError::wire(e.to_string()))?;
        wire::connect(&mut stream, token, request_id)?;
        let mut reader = SegmentReader::new(stream, request_id, fingerprint);
        // Full-pool blocks (the fork) need every pooled row so far; delta blocks (upstream)
        // only the segment's own, so the assembler then checks continuity and keeps nothing.
        let mut asm = Assembler::for_layout(writer.format().pool_layout());
        loop {
            let event = reader.next_event().map_err(|e| if control.is_cancelled() { CoreError::wire("cancelled by the decode host") } else { e })?;
            match event {
                Event::Segment(seg) => {
                    control.check()?;
                    writer.check_segment(&seg)?;
                    asm.absorb(&seg)?;
                    let index = seg.header.index as usize;
                    writer.write_views(index, &asm.views(&seg)?)?;
                    writer.flush()?;
                    blocks += 1;
                    on_block(index);
                }
                Event::Seal(seal) => return Ok(seal),
            }
        }
    })();
    Ingested { blocks, outcome }
}
