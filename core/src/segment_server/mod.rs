//! The prefill host's segment server: each capture's [`Outbox`], and the TCP side that lets a
//! decode host pull it.
//!
//! The server keeps an [`Outbox`] per capture, registered with the capture's key when the capture
//! starts; the capture side pushes segments into it as they complete and finally a seal. A decode
//! host connects, proves the capture's key in the wire's handshake ([`crate::wire::secure`]) and
//! receives that capture's segments as they arrive, encrypted — nothing is staged on disk, and a
//! segment leaves the prefill host's memory once it is sent. The decode host's side is
//! [`crate::ingest`].
//!
//! Bounded state, each bound in one module: at most [`ServerConfig::max_connections`]
//! connections ([`slots`]), each with a handshake deadline however slowly its peer sends, and a
//! pull waiting for its capture to start for at most [`ServerConfig::queue_wait`] (telling the
//! decode host every [`ServerConfig::keepalive`] that it is still waiting); segment
//! bytes of all outboxes together ([`memory`]); an outbox ([`outboxes`]) is dropped once its seal
//! is sent, when its reader goes away, when nobody pulled it within the grace after its seal (or
//! within the pull timeout), and — oldest unpulled first — when all outboxes together hold more
//! than the memory bound. A dropped outbox tells its capture why ([`Outbox::closed_reason`]), so
//! the capture stops computing. `core/tests/outbox_model.rs` checks these counts under shuttle's
//! schedules (feature `model-check`).

mod config;
pub mod memory;
pub mod outbox;
pub mod outboxes;
pub mod slots;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use config::ServerConfig;
pub use memory::SegmentMemory;
pub use outbox::Outbox;
pub use outboxes::Outboxes;
pub use slots::{ConnectionSlots, Slot};

use crate::error::{CoreError, Result};
use crate::wire::secure::{self, Hello};
use crate::wire::{self, CaptureKey, CaptureSecret, PromptDigest};

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
    token: Vec<u8>,
    outboxes: Arc<Outboxes>,
    slots: Arc<ConnectionSlots>,
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
        let slots = ConnectionSlots::new(config.max_connections);
        let outboxes = Outboxes::new(config);
        let (o, s) = (outboxes.clone(), slots.clone());
        std::thread::Builder::new()
            .name("pd-bridge-segments".into())
            .spawn(move || accept_loop(listener, o, s))
            .map_err(|e| CoreError::wire(format!("cannot start the segment server: {e}")))?;
        let weak = Arc::downgrade(&outboxes);
        std::thread::Builder::new()
            .name("pd-bridge-sweep".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_millis(200));
                match weak.upgrade() {
                    Some(o) if !o.is_shut_down() => o.sweep(Instant::now()),
                    _ => return,
                }
            })
            .map_err(|e| CoreError::wire(format!("cannot start the segment server: {e}")))?;
        Ok(SegmentServer { addr: local, token, outboxes, slots })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn config(&self) -> &ServerConfig {
        &self.outboxes.config
    }

    /// Register a capture's outbox: only a decode host holding `secret` (and the token) for this
    /// capture id, weights fingerprint and prompt can pull it.
    pub fn outbox(&self, request_id: &str, secret: &CaptureSecret, fingerprint: &str, prompt: &PromptDigest) -> Result<Arc<Outbox>> {
        let key = CaptureKey::derive(&self.token, secret, request_id, fingerprint, prompt)?;
        Ok(self.outboxes.register(request_id, key))
    }

    /// Outboxes registered and not yet dropped.
    pub fn outboxes(&self) -> usize {
        self.outboxes.len()
    }

    /// Segment bytes all outboxes hold now.
    pub fn queued_bytes(&self) -> u64 {
        self.outboxes.memory().used()
    }

    /// Times the segment memory was credited more than it held (0 unless a count broke).
    pub fn accounting_faults(&self) -> u64 {
        self.outboxes.memory().faults()
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.slots.open()
    }
}

impl Drop for SegmentServer {
    fn drop(&mut self) {
        self.outboxes.shut_down();
        // Wake the accept loop so it sees the flag and releases the port.
        let wake = if self.addr.ip().is_unspecified() { SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), self.addr.port()) } else { self.addr };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
    }
}

fn accept_loop(listener: TcpListener, outboxes: Arc<Outboxes>, slots: Arc<ConnectionSlots>) {
    for conn in listener.incoming() {
        if outboxes.is_shut_down() {
            return;
        }
        let Ok(mut stream) = conn else { continue };
        let slot = match slots.try_acquire() {
            Ok(slot) => slot,
            Err(open) => {
                tracing::warn!(open, cap = slots.cap(), "segment server at its connection cap; refusing a connection");
                let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                secure::refuse(&mut stream, &format!("busy: {open} connections open (cap {})", slots.cap()));
                continue;
            }
        };
        let o = outboxes.clone();
        let spawned = std::thread::Builder::new().name("pd-bridge-send".into()).spawn(move || {
            let _slot = slot;
            serve(stream, &o);
        });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a segment connection");
        }
    }
}

fn serve(stream: TcpStream, outboxes: &Outboxes) {
    let peer = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let config = &outboxes.config;
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
    let (outbox, matched) = match outboxes.find(&hello, config.queue_wait, config.keepalive, || secure::waiting(&mut timed)) {
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
    let lane = hello.lane;
    if let Err(why) = outbox.claim_lane(lane) {
        let _ = wire::send_error(&mut ch, &why);
        return;
    }
    ch.get_mut().deadline = None;
    let _ = ch.get_ref().stream.set_write_timeout(Some(config.idle));
    let mut sent = 0u32;
    let result = (|| -> Result<()> {
        let mut quiet_since = Instant::now();
        loop {
            match outbox.next_on(lane, config.keepalive.min(config.idle)) {
                Some(Ok(seg)) => {
                    wire::send_segment(&mut ch, &seg)?;
                    sent += 1;
                    quiet_since = Instant::now();
                }
                Some(Err(seal)) => return wire::send_seal(&mut ch, &seal),
                // A running capture between segments (a busy engine's step): say so.
                None if !outbox.is_closed() && quiet_since.elapsed() < config.idle => wire::send_waiting(&mut ch)?,
                None => {
                    let why = outbox.closed_reason().unwrap_or_else(|| format!("no segment for {:?}", config.idle));
                    let _ = wire::send_error(&mut ch, &why);
                    return Err(CoreError::wire(why));
                }
            }
        }
    })();
    match &result {
        // The last lane to send its seal retires the outbox; the others leave it to that one.
        Ok(()) if !outbox.lane_sent(lane) => return,
        Ok(()) => outbox.close(outbox::SENT.into()),
        Err(e) if lane.count == 1 => outbox.close(format!("the segment stream to the decode host ended after {sent} segments: {e}")),
        // One lane broken breaks the capture: the decode host cannot write past its gap.
        Err(e) => outbox.close(format!("lane {} of {} to the decode host ended after {sent} segments: {e}", lane.index, lane.count)),
    }
    outboxes.remove(&outbox);
}
