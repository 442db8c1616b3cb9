//! Streaming over TCP: the prefill host's segment server and the decode host's ingest.
//!
//! The server keeps an [`Outbox`] per capture, registered with the capture's key when the capture
//! starts; the capture side pushes segments into it as they complete and finally a seal. A decode
//! host connects, proves the capture's key in the wire's handshake ([`crate::wire::secure`]) and
//! receives that capture's segments as they arrive, encrypted — nothing is staged on disk, and a
//! segment leaves the prefill host's memory once it is sent. [`ingest`] is the decode side: it
//! verifies every segment, rebuilds the block and writes it, block by block.
//!
//! Bounded state on the prefill host: at most [`ServerConfig::max_connections`] connections,
//! each with a handshake deadline however slowly its peer sends; an outbox is dropped once its
//! seal is sent, when its reader goes away, when nobody pulled it within the grace after its
//! seal (or within the pull timeout), and — oldest unpulled first — when all outboxes together
//! hold more than the memory bound. A dropped outbox tells its capture why
//! ([`Outbox::closed_reason`]), so the capture stops computing.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use crate::block::BlockWriter;
use crate::error::{CoreError, Result};
use crate::segment::Segment;
use crate::wire::secure::{self, Hello, Matched};
use crate::wire::{self, CaptureKey, CaptureSecret, Event, FrameLimits, PromptDigest, Seal, SegmentReader};

/// The segment server's bounds and deadlines.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// How long a pulled stream waits for the capture's next segment, and how long a pull waits
    /// for its capture to start.
    pub idle: Duration,
    /// From accepting a connection to the client's first frame under the session keys (hello,
    /// handshake, pull), however slowly the client sends.
    pub handshake: Duration,
    /// Connections at once; more are refused at once.
    pub max_connections: usize,
    /// A sealed capture nobody pulled is dropped this long after its seal.
    pub grace: Duration,
    /// A capture nobody pulled is dropped this long after it started, sealed or not.
    pub pull_timeout: Duration,
    /// Segment bytes all outboxes may hold together; past it the oldest unpulled captures are
    /// dropped.
    pub memory_bound: u64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            idle: Duration::from_secs(60),
            handshake: Duration::from_secs(10),
            max_connections: 64,
            grace: Duration::from_secs(30),
            pull_timeout: Duration::from_secs(120),
            memory_bound: 1 << 30,
        }
    }
}

#[derive(Default)]
struct OutboxState {
    queue: VecDeque<(Segment, u64)>,
    queued_bytes: u64,
    seal: Option<Seal>,
    sealed_at: Option<Instant>,
    /// A decode host proved the key and is reading.
    pulled: bool,
    /// Why nothing more will be sent (the seal went out, the reader left, the outbox was dropped).
    closed: Option<String>,
}

/// One capture's segments on their way out.
pub struct Outbox {
    request_id: String,
    /// None: a capture nobody can pull (no secret): segments are counted and dropped.
    key: Option<CaptureKey>,
    created: Instant,
    shared: Weak<Shared>,
    state: Mutex<OutboxState>,
    ready: Condvar,
}

impl Outbox {
    fn new(request_id: &str, key: Option<CaptureKey>, shared: Weak<Shared>) -> Self {
        Outbox { request_id: request_id.into(), key, created: Instant::now(), shared, state: Mutex::default(), ready: Condvar::new() }
    }

    /// An outbox no decode host can pull (a capture without a secret, for tests and digests):
    /// pushes are accepted and dropped.
    pub fn detached(request_id: &str) -> Arc<Self> {
        Arc::new(Outbox::new(request_id, None, Weak::new()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutboxState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue a segment; false when the stream is closed (receiver gone, dropped, too far behind).
    ///
    /// One engine step may complete many blocks at once (a whole prompt in one step releases
    /// every block at its last layer), so what bounds a stream is bytes, not segments: past the
    /// server's memory bound the oldest unpulled captures are dropped first, and if the
    /// outboxes being read still hold more than the bound, this one, the stream growing, is
    /// given up (its decode host sees a broken stream and falls back).
    pub fn push(&self, seg: Segment) -> bool {
        if self.key.is_none() {
            return true;
        }
        let bytes = wire::segment_payload_len(&seg);
        {
            let mut s = self.lock();
            if s.closed.is_some() || s.seal.is_some() {
                return false;
            }
            s.queue.push_back((seg, bytes));
            s.queued_bytes += bytes;
            self.ready.notify_all();
        }
        if let Some(shared) = self.shared.upgrade() {
            let bound = shared.config.memory_bound;
            let total = shared.queued.fetch_add(bytes, Ordering::SeqCst) + bytes;
            if total > bound {
                shared.evict();
                let left = shared.queued.load(Ordering::SeqCst);
                if left > bound {
                    let mine = self.queued_bytes();
                    self.close(format!(
                        "the decode host is not reading fast enough: {} MiB queued for it, the prefill host's segment memory bound ({} MiB) is full",
                        mine >> 20,
                        bound >> 20
                    ));
                }
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

    fn close(&self, reason: String) {
        let freed = {
            let mut s = self.lock();
            if s.closed.is_none() {
                if reason != SENT {
                    tracing::warn!(request_id = %self.request_id, reason = %reason, "segment stream dropped");
                }
                s.closed = Some(reason);
            }
            s.queue.clear();
            std::mem::take(&mut s.queued_bytes)
        };
        self.ready.notify_all();
        self.release(freed);
    }

    fn release(&self, bytes: u64) {
        if let Some(shared) = self.shared.upgrade() {
            shared.queued.fetch_sub(bytes, Ordering::SeqCst);
        }
    }

    /// Take the outbox for one reader; false when another already has it or it is closed.
    fn claim(&self) -> bool {
        let mut s = self.lock();
        if s.pulled || s.closed.is_some() {
            return false;
        }
        s.pulled = true;
        true
    }

    /// Next thing to send: a segment, then the seal once the queue is empty; None when the
    /// deadline passes or the outbox was closed.
    fn next(&self, deadline: Instant) -> Option<std::result::Result<Segment, Seal>> {
        let mut s = self.lock();
        loop {
            if s.closed.is_some() {
                return None;
            }
            if let Some((seg, bytes)) = s.queue.pop_front() {
                s.queued_bytes -= bytes;
                drop(s);
                self.release(bytes);
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

    fn expired(&self, config: &ServerConfig, now: Instant) -> Option<String> {
        let s = self.lock();
        if s.pulled || s.closed.is_some() {
            return None;
        }
        if let Some(at) = s.sealed_at {
            if now.duration_since(at) > config.grace {
                return Some(format!("sealed but not pulled within the {:?} grace", config.grace));
            }
        }
        (now.duration_since(self.created) > config.pull_timeout).then(|| format!("not pulled within {:?} of its start", config.pull_timeout))
    }
}

/// The close reason of an outbox whose seal went out.
const SENT: &str = "sent";

struct Shared {
    token: Vec<u8>,
    config: ServerConfig,
    registry: Mutex<HashMap<String, Vec<Arc<Outbox>>>>,
    registered: Condvar,
    queued: AtomicU64,
    connections: AtomicUsize,
    shutdown: AtomicBool,
}

impl Shared {
    fn registry(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Arc<Outbox>>>> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Over the memory bound: drop unpulled captures, oldest first, until under it.
    fn evict(&self) {
        let reg = self.registry();
        let mut unpulled: Vec<&Arc<Outbox>> = reg.values().flatten().filter(|o| {
            let s = o.lock();
            !s.pulled && s.closed.is_none()
        }).collect();
        unpulled.sort_by_key(|o| o.created);
        let bound = self.config.memory_bound;
        for o in unpulled {
            if self.queued.load(Ordering::SeqCst) <= bound {
                break;
            }
            o.close(format!("dropped unpulled: the prefill host's segment memory bound ({} MiB) was exceeded and this was the oldest capture nobody had pulled", bound >> 20));
        }
    }

    fn remove(&self, outbox: &Arc<Outbox>) {
        let mut reg = self.registry();
        if let Some(list) = reg.get_mut(&outbox.request_id) {
            list.retain(|o| !Arc::ptr_eq(o, outbox));
            if list.is_empty() {
                reg.remove(&outbox.request_id);
            }
        }
    }

    /// Drop outboxes past their grace or pull timeout, and closed ones nobody serves.
    fn sweep(&self) {
        let now = Instant::now();
        let mut reg = self.registry();
        for list in reg.values_mut() {
            for o in list.iter() {
                if let Some(why) = o.expired(&self.config, now) {
                    o.close(why);
                }
            }
            list.retain(|o| {
                let s = o.lock();
                s.closed.is_none() || s.pulled
            });
        }
        reg.retain(|_, l| !l.is_empty());
    }

    /// The unpulled outbox of `hello`'s capture whose key the client used: waits up to `wait`
    /// for the capture to start (a decode host connects as it sends the prefill request);
    /// refuses at once when captures of that id exist and none matches.
    fn find(&self, hello: &Hello, wait: Duration) -> std::result::Result<(Arc<Outbox>, Matched), String> {
        let deadline = Instant::now() + wait;
        let mut reg = self.registry();
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return Err("the segment server is stopping".into());
            }
            if let Some(list) = reg.get(&hello.request_id) {
                let open: Vec<&Arc<Outbox>> = list.iter().filter(|o| o.lock().closed.is_none()).collect();
                for o in &open {
                    if let Some(m) = o.key.as_ref().and_then(|k| hello.try_key(k)) {
                        return Ok(((*o).clone(), m));
                    }
                }
                if !open.is_empty() {
                    return Err("unauthorized: no capture with this id for this key".into());
                }
            }
            let now = Instant::now();
            if now >= deadline {
                // A pull that comes before its capture starts (the decode host connects as it
                // sends the prefill request) waits this long at most.
                return Err(format!("unauthorized: no capture with this id for this key started within {wait:?}"));
            }
            reg = self.registered.wait_timeout(reg, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
}

/// A TCP stream whose reads fail once `deadline` passes, however the bytes trickle in.
struct Timed {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(d) = self.deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the handshake deadline passed"));
            }
            self.stream.set_read_timeout(Some(left))?;
        }
        self.stream.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// The prefill host's segment server.
pub struct SegmentServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl SegmentServer {
    /// Listen on `addr` with the default bounds and `idle` as the idle deadline.
    pub fn bind(addr: &str, token: Vec<u8>, idle: Duration) -> Result<Self> {
        Self::bind_with(addr, token, ServerConfig { idle, ..ServerConfig::default() })
    }

    /// Listen on `addr`; pulls must prove a capture's key, derived with `token`.
    pub fn bind_with(addr: &str, token: Vec<u8>, config: ServerConfig) -> Result<Self> {
        if token.is_empty() {
            return Err(CoreError::config("token", "the shared token must not be empty"));
        }
        if config.max_connections == 0 {
            return Err(CoreError::config("max_connections", "must be at least 1"));
        }
        let listener = TcpListener::bind(addr).map_err(|e| CoreError::wire(format!("cannot listen on {addr}: {e}")))?;
        let local = listener.local_addr().map_err(|e| CoreError::wire(e.to_string()))?;
        let shared = Arc::new(Shared {
            token,
            config,
            registry: Mutex::default(),
            registered: Condvar::new(),
            queued: AtomicU64::new(0),
            connections: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
        });
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("pd-bridge-segments".into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| CoreError::wire(format!("cannot start the segment server: {e}")))?;
        let weak = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("pd-bridge-sweep".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(200));
                match weak.upgrade() {
                    Some(s) if !s.shutdown.load(Ordering::SeqCst) => s.sweep(),
                    _ => return,
                }
            })
            .map_err(|e| CoreError::wire(format!("cannot start the segment server: {e}")))?;
        Ok(SegmentServer { addr: local, shared })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn config(&self) -> &ServerConfig {
        &self.shared.config
    }

    /// Register a capture's outbox: only a decode host holding `secret` (and the token) for this
    /// capture id, weights fingerprint and prompt can pull it.
    pub fn outbox(&self, request_id: &str, secret: &CaptureSecret, fingerprint: &str, prompt: &PromptDigest) -> Result<Arc<Outbox>> {
        let key = CaptureKey::derive(&self.shared.token, secret, request_id, fingerprint, prompt)?;
        let outbox = Arc::new(Outbox::new(request_id, Some(key), Arc::downgrade(&self.shared)));
        self.shared.registry().entry(request_id.to_string()).or_default().push(outbox.clone());
        self.shared.registered.notify_all();
        Ok(outbox)
    }

    /// Outboxes registered and not yet dropped.
    pub fn outboxes(&self) -> usize {
        self.shared.registry().values().map(Vec::len).sum()
    }

    /// Segment bytes all outboxes hold now.
    pub fn queued_bytes(&self) -> u64 {
        self.shared.queued.load(Ordering::SeqCst)
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.shared.connections.load(Ordering::SeqCst)
    }
}

impl Drop for SegmentServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.registered.notify_all();
        for o in self.shared.registry().values().flatten() {
            o.close("the segment server stopped".into());
        }
        // Wake the accept loop so it sees the flag and releases the port.
        let wake = if self.addr.ip().is_unspecified() { SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), self.addr.port()) } else { self.addr };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
    }
}

/// Counts a connection while it lives.
struct Slot(Arc<Shared>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut stream) = conn else { continue };
        let open = shared.connections.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(shared.clone());
        if open >= shared.config.max_connections {
            tracing::warn!(open, cap = shared.config.max_connections, "segment server at its connection cap; refusing a connection");
            let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
            secure::refuse(&mut stream, &format!("busy: {open} connections open (cap {})", shared.config.max_connections));
            continue;
        }
        let spawned = std::thread::Builder::new().name("pd-bridge-send".into()).spawn(move || {
            let slot = slot;
            serve(stream, &slot.0);
        });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a segment connection");
        }
    }
}

fn serve(stream: TcpStream, shared: &Arc<Shared>) {
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let config = &shared.config;
    let _ = stream.set_nodelay(true);
    let _ = stream.set_write_timeout(Some(config.handshake));
    let mut timed = Timed { stream, deadline: Some(Instant::now() + config.handshake) };
    let hello = match Hello::read(&mut timed) {
        Ok(h) => h,
        Err(e) => {
            tracing::warn!(peer = %peer, error = %e, "refused a segment connection before its hello");
            return;
        }
    };
    let request_id = hello.request_id.clone();
    let (outbox, matched) = match shared.find(&hello, config.idle) {
        Ok(m) => m,
        Err(why) => {
            tracing::warn!(request_id = %request_id, peer = %peer, "refused a pull: {why}");
            secure::refuse(&mut timed, &why);
            return;
        }
    };
    // The wait for the capture was ours; the client gets its own deadline for the rest.
    timed.deadline = Some(Instant::now() + config.handshake);
    let mut ch = match secure::accept(timed, &hello, matched) {
        Ok(ch) => ch,
        Err(e) => {
            tracing::warn!(request_id = %request_id, peer = %peer, error = %e, "a pull failed its handshake");
            return;
        }
    };
    if !outbox.claim() {
        let _ = wire::send_error(&mut ch, "this capture is already being pulled, or was dropped");
        return;
    }
    ch.get_mut().deadline = None;
    let _ = ch.get_ref().stream.set_write_timeout(Some(config.idle));
    let mut sent = 0u32;
    let result = (|| -> Result<()> {
        loop {
            match outbox.next(Instant::now() + config.idle) {
                Some(Ok(seg)) => {
                    wire::send_segment(&mut ch, &seg)?;
                    sent += 1;
                }
                Some(Err(seal)) => return wire::send_seal(&mut ch, &seal),
                None => {
                    let why = outbox.closed_reason().unwrap_or_else(|| format!("no segment for {:?}", config.idle));
                    let _ = wire::send_error(&mut ch, &why);
                    return Err(CoreError::wire(why));
                }
            }
        }
    })();
    match &result {
        Ok(()) => outbox.close(SENT.into()),
        Err(e) => outbox.close(format!("the segment stream to the decode host ended after {sent} segments: {e}")),
    }
    shared.remove(&outbox);
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
/// (flushed before `on_block(index)` is called), and stop at the seal. A broken stream keeps
/// every block already written: each is whole and verified.
pub fn ingest(pull: &Pull<'_>, writer: &BlockWriter, control: &IngestControl, mut on_block: impl FnMut(usize)) -> Ingested {
    let mut blocks = 0usize;
    let outcome = (|| -> Result<Seal> {
        control.check()?;
        let key = CaptureKey::derive(pull.token, pull.secret, pull.request_id, pull.fingerprint, &pull.prompt)?;
        let stream = connect_any(&pull.addrs, pull.timeout)?;
        control.attach(&stream)?;
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(Some(pull.timeout)).and_then(|_| stream.set_write_timeout(Some(pull.timeout))).map_err(|e| CoreError::wire(e.to_string()))?;
        let cancelled = |e: CoreError| if control.is_cancelled() { CoreError::wire("cancelled by the decode host") } else { e };
        let channel = secure::connect(stream, &key, pull.request_id).map_err(cancelled)?;
        // A writer resumed at a block boundary expects the stream from there (else block 0).
        let first = writer.next_block();
        let mut reader = SegmentReader::with_limits(channel, pull.request_id, pull.fingerprint, pull.limits).starting_at(first as u32, (first * writer.block_size()) as u64);
        loop {
            match reader.next_event().map_err(cancelled)? {
                Event::Segment(seg) => {
                    control.check()?;
                    // The writer's one entry point: checked against the plan and the block grid
                    // before anything is written.
                    writer.write_segment(&seg)?;
                    let index = seg.header.index as usize;
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
