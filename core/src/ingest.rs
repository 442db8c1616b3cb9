//! The decode host's side of the segment stream: pull one capture from the prefill host's
//! [`crate::segment_server`], verify every segment, rebuild its block and write it, block by
//! block. A broken stream keeps every block already written: each is whole and verified.
//!
//! A capture may come over several lanes ([`crate::wire::lanes`]): each lane is read, opened and
//! decoded on its own thread, and the blocks are written here in chain order, one at a time.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Mutex;
use std::time::Duration;

use crate::block::{BlockWriter, Landed};
use crate::error::{CoreError, Result};
use crate::segment::Segment;
use crate::stages;
use crate::wire::secure::{self, SecureChannel};
use crate::wire::{CaptureKey, CaptureSecret, Event, FrameLimits, Lane, LaneMerge, PromptDigest, Seal, SegmentReader};

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
/// One per pull: once stopped, it stays stopped.
#[derive(Default)]
pub struct IngestControl {
    cancelled: AtomicBool,
    /// Every lane's stream, so that a cancel (or one lane's failure) stops them all; true once
    /// they were stopped, so that a lane still connecting then is stopped as it attaches.
    streams: Mutex<(Vec<TcpStream>, bool)>,
}

impl IngestControl {
    /// Stop the ingest: a blocked read returns at once; blocks already written stay (each is
    /// whole and verified); nothing more is written.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.shut_streams();
    }

    /// Unblock every lane's reads (a lane failed, so the capture cannot be written past it).
    fn shut_streams(&self) {
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        streams.1 = true;
        for s in streams.0.iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    fn attach(&self, stream: &TcpStream) -> Result<()> {
        let clone = stream.try_clone().map_err(|e| CoreError::wire(e.to_string()))?;
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if streams.1 {
            let _ = clone.shutdown(std::net::Shutdown::Both);
            drop(streams);
            self.check()?;
            return Err(CoreError::wire("another lane of this pull failed"));
        }
        streams.0.push(clone);
        drop(streams);
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
    /// Streams to pull the capture over (1 to [`crate::wire::MAX_LANES`]): more lanes seal and
    /// open its records on more cores at both ends, for links faster than one core encrypts.
    pub lanes: u8,
    /// The prefill host's pipeline stages (1 to [`crate::stages::MAX_STAGES`]): stage `s`
    /// serves its layers' part of each block on the segment port + `s`, over one stream each,
    /// and the parts are joined into whole blocks ([`crate::stages`]).
    pub stages: u8,
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
    let mut write = |seg: &Segment| -> Result<()> {
        control.check()?;
        // The writer's one entry point: checked against the plan and the block grid before
        // anything is written.
        let written = writer.write_segment(seg)?;
        writer.flush()?;
        let landed = writer.landed(seg.header.index as usize, written)?;
        blocks += 1;
        on_block(&landed);
        Ok(())
    };
    let outcome = (|| -> Result<Seal> {
        control.check()?;
        let key = CaptureKey::derive(pull.token, pull.secret, pull.request_id, pull.fingerprint, &pull.prompt)?;
        // A writer resumed at a block boundary expects the stream from there (else block 0).
        let first = writer.next_block();
        let start = (first * writer.block_size()) as u64;
        if pull.stages > 1 {
            return pull_stages(pull, &key, control, first as u32, start, &mut write);
        }
        if pull.lanes <= 1 {
            let mut reader = open_lane(pull, &pull.addrs, &key, control, Lane::SINGLE)?.starting_at(first as u32, start);
            loop {
                match reader.next_event().map_err(|e| cancelled(control, e))? {
                    Event::Segment(seg) => write(&seg)?,
                    Event::Seal(seal) => return Ok(seal),
                }
            }
        }
        let lanes = Lane::all(pull.lanes)?;
        // The first lane failure, which the other lanes' (consequent) failures must not hide.
        let failure: Mutex<Option<CoreError>> = Mutex::new(None);
        std::thread::scope(|scope| {
            let receivers: Vec<Receiver<Result<Event>>> = lanes
                .iter()
                .map(|&lane| {
                    let (tx, rx) = sync_channel::<Result<Event>>(1);
                    let (key, failure) = (&key, &failure);
                    scope.spawn(move || {
                        let run = || forward(open_lane(pull, &pull.addrs, key, control, lane)?.starting_at(first as u32, start), &tx);
                        if let Err(e) = run() {
                            let e = cancelled(control, e);
                            let told = CoreError::wire(format!("lane {} of {}: {e}", lane.index, lane.count));
                            failure.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                            control.shut_streams();
                            let _ = tx.send(Err(told));
                        }
                    });
                    rx
                })
                .collect();
            // A lane's failure is stored before the merge hears of it; taken before our own
            // failure shuts the other lanes (whose errors would then only echo it).
            let result = merge(&lanes, &receivers, first as u32, start, &mut write).map_err(|e| failure.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or(e));
            if result.is_err() {
                control.shut_streams();
            }
            result
        })
    })();
    Ingested { blocks, outcome }
}

/// Hand a stream's events to the thread that merges them, up to and including its seal (or until
/// that thread stopped listening).
fn forward<F: crate::wire::FrameSource>(mut reader: SegmentReader<F>, tx: &std::sync::mpsc::SyncSender<Result<Event>>) -> Result<()> {
    loop {
        let event = reader.next_event()?;
        let sealed = matches!(event, Event::Seal(_));
        if tx.send(Ok(event)).is_err() || sealed {
            return Ok(());
        }
    }
}

/// A read error, or the cancel that caused it.
fn cancelled(control: &IngestControl, e: CoreError) -> CoreError {
    if control.is_cancelled() {
        CoreError::wire("cancelled by the decode host")
    } else {
        e
    }
}

/// Connect (to `addrs`: the pull's, or a pipeline stage's), handshake and a reader for one lane
/// of the pull.
fn open_lane(pull: &Pull<'_>, addrs: &[SocketAddr], key: &CaptureKey, control: &IngestControl, lane: Lane) -> Result<SegmentReader<SecureChannel<Idle>>> {
    let stream = connect_any(addrs, pull.timeout)?;
    control.attach(&stream)?;
    let _ = stream.set_nodelay(true);
    stream.set_read_timeout(Some(pull.timeout)).and_then(|_| stream.set_write_timeout(Some(pull.timeout))).map_err(|e| CoreError::wire(e.to_string()))?;
    let idle = Idle { stream, deadline: pull.timeout };
    let channel = secure::connect_lane(idle, key, pull.request_id, lane).map_err(|e| cancelled(control, e))?;
    Ok(SegmentReader::with_limits(channel, pull.request_id, pull.fingerprint, pull.limits).on_lane(lane))
}

/// Pull every pipeline stage (each over one stream, on a thread of its own) and write each block
/// once every stage's part of it has arrived, joined; the capture ends where the first stage that
/// did not complete ended ([`stages::end`]), and the other stages' streams are shut then.
fn pull_stages(pull: &Pull<'_>, key: &CaptureKey, control: &IngestControl, first: u32, start: u64, write: &mut impl FnMut(&Segment) -> Result<()>) -> Result<Seal> {
    if pull.stages > stages::MAX_STAGES {
        return Err(CoreError::wire(format!("{} pipeline stages: at most {} are pulled", pull.stages, stages::MAX_STAGES)));
    }
    let count = pull.stages as usize;
    let stage_addrs = (0..count)
        .map(|s| {
            pull.addrs
                .iter()
                .map(|a| a.port().checked_add(s as u16).map(|p| SocketAddr::new(a.ip(), p)).ok_or_else(|| CoreError::wire(format!("pipeline stage {} of {count}: segment port {} + {s} is past 65535", s + 1, a.port()))))
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let failure: Mutex<Option<CoreError>> = Mutex::new(None);
    std::thread::scope(|scope| {
        let receivers: Vec<Receiver<Result<Event>>> = stage_addrs
            .iter()
            .enumerate()
            .map(|(s, addrs)| {
                let (tx, rx) = sync_channel::<Result<Event>>(1);
                let failure = &failure;
                scope.spawn(move || {
                    let run = || forward(open_lane(pull, addrs, key, control, Lane::SINGLE)?.starting_at(first, start), &tx);
                    if let Err(e) = run() {
                        let e = CoreError::wire(format!("pipeline stage {} of {count}: {}", s + 1, cancelled(control, e)));
                        failure.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(CoreError::wire(e.to_string()));
                        control.shut_streams();
                        let _ = tx.send(Err(e));
                    }
                });
                rx
            })
            .collect();
        let result = (|| -> Result<Seal> {
            let mut next = first;
            loop {
                let mut said = Vec::with_capacity(count);
                for (s, rx) in receivers.iter().enumerate() {
                    let event = rx.recv().unwrap_or_else(|_| Err(CoreError::wire(format!("pipeline stage {} of {count} ended without a seal", s + 1))))?;
                    said.push(match event {
                        Event::Segment(seg) => stages::Said::Part(seg),
                        Event::Seal(seal) => stages::Said::Seal(seal),
                    });
                    // A stage that did not complete ends the capture at once: the others' parts
                    // of this block cannot make it whole.
                    if let Some(seal) = stages::end(&said, count, next)? {
                        return Ok(seal);
                    }
                }
                let parts = said.into_iter().map(|x| match x {
                    stages::Said::Part(seg) => seg,
                    stages::Said::Seal(_) => unreachable!("end() returned a seal"),
                });
                write(&stages::join(parts.collect())?)?;
                next += 1;
            }
        })()
        .map_err(|e| failure.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or(e));
        // The capture has ended (or failed): the other stages' streams are not read again.
        control.shut_streams();
        result
    })
}

/// Take segment `i` from lane `i % lanes` until every lane has sealed, writing each in order.
fn merge(lanes: &[Lane], receivers: &[Receiver<Result<Event>>], first: u32, start: u64, write: &mut impl FnMut(&Segment) -> Result<()>) -> Result<Seal> {
    let mut merged = LaneMerge::starting_at(first, start);
    let mut sealed = vec![false; lanes.len()];
    let recv = |k: usize| receivers[k].recv().unwrap_or_else(|_| Err(CoreError::wire(format!("lane {k} of {} ended without a seal", lanes.len()))));
    loop {
        let k = (merged.next_index() % lanes.len() as u32) as usize;
        if sealed[k] {
            // The lane owing the next segment has sealed: the capture ended here, and every
            // other lane must seal too.
            for k in (0..lanes.len()).filter(|&k| !sealed[k]) {
                match recv(k)? {
                    Event::Seal(seal) => merged.seal(seal)?,
                    Event::Segment(seg) => return Err(CoreError::wire(format!("lane {k} sent segment {} after the capture's seal on another lane", seg.header.index))),
                }
            }
            return merged.finish();
        }
        match recv(k)? {
            Event::Segment(seg) => {
                merged.segment(seg.header.index, seg.header.start, seg.header.end)?;
                write(&seg)?;
            }
            Event::Seal(seal) => {
                merged.seal(seal)?;
                sealed[k] = true;
            }
        }
    }
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
