//! Many bridges at once on one prefill host (issue 20): 20 captures a round over real loopback
//! TCP, their decode hosts reading at different speeds, some poisoned, some abandoned (nobody
//! pulls them), some cancelled by their decode host mid-stream, over several rounds. Every
//! healthy capture seals `complete` with blocks identical to a one-at-a-time write, every
//! unhealthy one fails alone with its own reason, and after each round the server holds no
//! outbox, no connection and no segment byte, and never miscounted one.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use pd_bridge_core::block::{block_path, BlockWriter};
use pd_bridge_core::capture::Capture;
use pd_bridge_core::ingest::IngestControl;
use pd_bridge_core::segment::Segment;
use pd_bridge_core::segment_server::{SegmentServer, ServerConfig};
use pd_bridge_core::wire::{CaptureSecret, PromptDigest, Seal};
use pd_bridge_core::{CoreError, DecoderWeights, OmlxFormat};

use common::{random_rows, temp_dir, v4_model_dir, Rng};

const BLOCK: usize = 128;
const BLOCKS: usize = 4;
const CAPTURES: usize = 20;
const ROUNDS: usize = 8;
const PROMPTS: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// Pulled and read whole; `u64` is the reader's pause per block, in ms.
    Healthy(u64),
    /// Its prefill host sends a NaN in block 2.
    Poisoned,
    /// Nobody pulls it: the server drops it after its grace.
    Abandoned,
    /// Its decode host cancels after the first block.
    Cancelled,
}

fn kind(i: usize) -> Kind {
    match i % 10 {
        3 => Kind::Poisoned,
        6 => Kind::Abandoned,
        8 => Kind::Cancelled,
        k => Kind::Healthy([0, 1, 5, 15][k % 4]),
    }
}

fn secret(i: usize) -> CaptureSecret {
    CaptureSecret::from_hex(&format!("{:02x}", 16 + i).repeat(32)).unwrap()
}

struct Prompt {
    tokens: Vec<u32>,
    segments: Vec<Segment>,
    seal: Seal,
    /// The blocks written one at a time, straight from the segments.
    direct: std::path::PathBuf,
}

fn prompts(w: &Arc<DecoderWeights>) -> Vec<Prompt> {
    (0..PROMPTS)
        .map(|p| {
            let len = BLOCKS * BLOCK + 5;
            let mut rng = Rng::new(100 + p as u64);
            let mut cap = Capture::with_format(OmlxFormat::Upstream063, w.clone(), "one", len, BLOCK).unwrap();
            for l in 0..w.plan.num_layers() {
                cap.feed(l, 0, &random_rows(&mut rng, len, w.plan.hidden_size())).unwrap();
            }
            let segments = cap.take_ready();
            let seal = cap.seal(None);
            let tokens: Vec<u32> = (0..len as u32).map(|t| t * 7 + p as u32).collect();
            let direct = temp_dir("direct");
            let wd = BlockWriter::with_format(OmlxFormat::Upstream063, &direct, "m", BLOCK, &tokens).unwrap().with_plan(&w.plan).unwrap();
            for s in &segments {
                wd.write_segment(s).unwrap();
            }
            wd.flush().unwrap();
            Prompt { tokens, segments, seal, direct }
        })
        .collect()
}

/// Wait until the server has let go of everything (its connection threads end on their own).
fn settle(server: &SegmentServer, round: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (o, c, q) = (server.outboxes(), server.connections(), server.queued_bytes());
        if (o, c, q) == (0, 0, 0) {
            return;
        }
        assert!(Instant::now() < deadline, "round {round}: the server still holds {o} outboxes, {c} connections, {q} bytes");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn many_captures_at_once_each_fail_or_succeed_alone_and_the_server_returns_to_zero() {
    let w = Arc::new(DecoderWeights::load(v4_model_dir(91)).unwrap());
    let prompts = prompts(&w);
    // The grace runs from the seal to the pull's claim: on a loaded 2-core machine 40 threads may
    // take longer than a fraction of a second to connect and handshake (a pulled capture dropped
    // at 600 ms would read as a failure of the server), so it is seconds, as in production.
    let config = ServerConfig { idle: Duration::from_secs(30), grace: Duration::from_secs(3), pull_timeout: Duration::from_secs(20), ..ServerConfig::default() };
    let server = SegmentServer::bind_with("127.0.0.1:0", b"tok".to_vec(), config).unwrap();
    for round in 0..ROUNDS {
        let dirs: Vec<_> = (0..CAPTURES).map(|_| temp_dir("many")).collect();
        let results = std::thread::scope(|sc| {
            let mut producers = vec![];
            let mut readers = vec![];
            for i in 0..CAPTURES {
                let (k, p) = (kind(i), &prompts[(i + round) % PROMPTS]);
                let id = format!("r{round}-c{i}");
                let outbox = server.outbox(&id, &secret(i), &w.fingerprint, &PromptDigest::of(&p.tokens)).unwrap();
                let mut segs = p.segments.clone();
                for s in &mut segs {
                    s.header.request_id = id.clone();
                }
                if k == Kind::Poisoned {
                    segs[2].arrays[0][3] = bf16::NAN;
                }
                let seal = p.seal.clone();
                producers.push(sc.spawn(move || {
                    let mut rng = Rng::new((round * 1000 + i) as u64);
                    for s in segs {
                        std::thread::sleep(Duration::from_millis(rng.below(4) as u64));
                        if !outbox.push(s) {
                            // Only a stream its decode host gave up may stop taking segments.
                            assert!(matches!(k, Kind::Poisoned | Kind::Cancelled), "{k:?} capture {i} closed: {:?}", outbox.closed_reason());
                            break;
                        }
                    }
                    outbox.seal(seal);
                    if k == Kind::Abandoned {
                        // Nobody pulls it: the server drops it after its grace and says why.
                        let deadline = Instant::now() + Duration::from_secs(30);
                        while outbox.closed_reason().is_none() && Instant::now() < deadline {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                    outbox.closed_reason()
                }));
                if k == Kind::Abandoned {
                    readers.push(None);
                    continue;
                }
                let (server, w, dir) = (&server, &w, &dirs[i]);
                readers.push(Some(sc.spawn(move || {
                    let writer = BlockWriter::with_format(OmlxFormat::Upstream063, dir, "m", BLOCK, &p.tokens).unwrap().with_plan(&w.plan).unwrap();
                    let control = IngestControl::default();
                    let got = common::pull(server, w, &id, &secret(i), &p.tokens, &writer, BLOCK, Duration::from_secs(30), &control, |_| match k {
                        Kind::Healthy(ms) => std::thread::sleep(Duration::from_millis(ms)),
                        Kind::Cancelled => control.cancel(),
                        _ => {}
                    });
                    (got, writer)
                })));
            }
            let closed: Vec<_> = producers.into_iter().map(|h| h.join().unwrap()).collect();
            let pulled: Vec<_> = readers.into_iter().map(|h| h.map(|h| h.join().unwrap())).collect();
            (closed, pulled)
        });
        let (closed, pulled) = results;
        for i in 0..CAPTURES {
            let (k, p) = (kind(i), &prompts[(i + round) % PROMPTS]);
            let ctx = format!("round {round} capture {i} ({k:?})");
            match (k, &pulled[i]) {
                (Kind::Healthy(_), Some((got, writer))) => {
                    assert_eq!(got.outcome.as_ref().ok(), Some(&p.seal), "{ctx}: {:?}", got.outcome);
                    assert_eq!(got.blocks, BLOCKS, "{ctx}");
                    assert_eq!(closed[i], None, "{ctx}");
                    for b in 0..BLOCKS {
                        common::assert_same_block(&block_path(&p.direct, writer.hash(b).unwrap()), &block_path(&dirs[i], writer.hash(b).unwrap()));
                    }
                }
                (Kind::Poisoned, Some((got, _))) => {
                    match &got.outcome {
                        Err(CoreError::Segment { block: 2, reason, .. }) => assert!(reason.contains("NaN"), "{ctx}: {reason}"),
                        other => panic!("{ctx}: {other:?}"),
                    }
                    assert_eq!(got.blocks, 2, "{ctx}");
                }
                (Kind::Cancelled, Some((got, _))) => {
                    let err = got.outcome.as_ref().unwrap_err().to_string();
                    assert!(err.contains("cancelled by the decode host"), "{ctx}: {err}");
                    assert!(got.blocks >= 1 && got.blocks < BLOCKS, "{ctx}: {}", got.blocks);
                }
                (Kind::Abandoned, None) => {
                    let why = closed[i].as_deref().unwrap_or("still open");
                    assert!(why.contains("sealed but not pulled"), "{ctx}: {why}");
                }
                (k, _) => unreachable!("{k:?}"),
            }
        }
        settle(&server, round);
        assert_eq!(server.accounting_faults(), 0, "round {round}");
    }
}
