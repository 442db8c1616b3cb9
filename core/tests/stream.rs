//! Segments over real loopback TCP: a capture streams while it is fed; the decode side ingests
//! and writes blocks as they arrive. Wrong tokens and a prefill host that dies mid-stream.

mod common;

use std::sync::Arc;
use std::time::Duration;

use pd_bridge_core::block::validate::{inspect, Expect};
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::capture::Capture;
use pd_bridge_core::ingest::{ingest, IngestControl, Ingested, Pull};
use pd_bridge_core::segment_server::{SegmentServer, ServerConfig};
use pd_bridge_core::wire::{CaptureSecret, FrameLimits, PromptDigest, Seal};
use pd_bridge_core::{CacheBuilder, DecoderSteps, DecoderWeights, CoreError};

use common::{random_rows, temp_dir, v4_model_dir, Rng};

const BLOCK: usize = 128;

fn secret() -> CaptureSecret {
    CaptureSecret::from_hex(&"5e".repeat(32)).unwrap()
}

/// Pull "req" (or `id`) from `server` with `token` and the test secret, for `tokens`.
fn pull(server: &SegmentServer, token: &[u8], id: &str, w: &DecoderWeights, tokens: &[u32], writer: &BlockWriter, timeout: Duration, control: &IngestControl, on_block: impl FnMut(&pd_bridge_core::block::Landed)) -> Ingested {
    pull_lanes(1, server, token, id, w, tokens, writer, timeout, control, on_block)
}

/// [`pull`] over `lanes` streams.
#[allow(clippy::too_many_arguments)]
fn pull_lanes(lanes: u8, server: &SegmentServer, token: &[u8], id: &str, w: &DecoderWeights, tokens: &[u32], writer: &BlockWriter, timeout: Duration, control: &IngestControl, on_block: impl FnMut(&pd_bridge_core::block::Landed)) -> Ingested {
    let s = secret();
    let p = Pull {
        addrs: vec![server.local_addr()],
        token,
        secret: &s,
        request_id: id,
        fingerprint: &w.fingerprint,
        prompt: PromptDigest::of(tokens),
        limits: FrameLimits::for_plan(&w.plan, writer.format(), BLOCK),
        timeout,
        lanes,
        stages: 1,
    };
    ingest(&p, writer, control, on_block)
}

fn setup(prompt: usize) -> (Arc<DecoderWeights>, Vec<Vec<half::bf16>>, Vec<u32>) {
    let w = Arc::new(DecoderWeights::load(v4_model_dir(41)).unwrap());
    let mut rng = Rng::new(3);
    let inputs = (0..w.plan.num_layers()).map(|_| random_rows(&mut rng, prompt, w.plan.hidden_size())).collect();
    (w, inputs, (0..prompt as u32).collect())
}

/// Feed the capture in 100-token (or `chunk`-token) chunks on another thread, pushing segments as they complete;
/// stop after `stop_after` tokens without sealing if asked (a dying prefill host).
fn prefill(server: &SegmentServer, w: Arc<DecoderWeights>, inputs: Vec<Vec<half::bf16>>, prompt: usize, stop_after: Option<usize>) -> std::thread::JoinHandle<()> {
    prefill_in_chunks(server, w, inputs, prompt, stop_after, 100)
}

fn prefill_in_chunks(server: &SegmentServer, w: Arc<DecoderWeights>, inputs: Vec<Vec<half::bf16>>, prompt: usize, stop_after: Option<usize>, chunk: usize) -> std::thread::JoinHandle<()> {
    let tokens: Vec<u32> = (0..prompt as u32).collect();
    let outbox = server.outbox("req", &secret(), &w.fingerprint, &PromptDigest::of(&tokens)).unwrap();
    std::thread::spawn(move || {
        let hidden = w.plan.hidden_size();
        let mut cap = Capture::new(w.clone(), "req", prompt, BLOCK).unwrap();
        let mut start = 0;
        while start < prompt {
            let end = (start + chunk).min(prompt);
            if stop_after.is_some_and(|s| start >= s) {
                return;
            }
            for (l, x) in inputs.iter().enumerate() {
                cap.feed(l, start, &x[start * hidden..end * hidden]).unwrap();
            }
            for seg in cap.take_ready() {
                outbox.push(seg);
            }
            start = end;
        }
        outbox.seal(cap.seal(None));
    })
}

#[test]
fn streamed_blocks_arrive_whole_and_in_order() {
    let prompt = 5 * BLOCK + 37;
    let (w, inputs, tokens) = setup(prompt);
    let server = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(20)).unwrap();
    let producer = prefill(&server, w.clone(), inputs.clone(), prompt, None);
    let dir = temp_dir("ingest");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let mut order = Vec::new();
    let mut landed = Vec::new();
    let got = pull(&server, b"tok", "req", &w, &tokens, &writer, Duration::from_secs(20), &IngestControl::default(), |b| {
        order.push(b.index);
        landed.push(b.clone());
    });
    producer.join().unwrap();
    assert_eq!(got.outcome.unwrap(), Seal::Complete { blocks: 5, tokens: 5 * BLOCK as u64 });
    assert_eq!(order, vec![0, 1, 2, 3, 4]);
    // Each block arrives with its path, hash and the validator's verdict on the file as it lies.
    for b in &landed {
        assert_eq!(b.hash, *writer.hash(b.index).unwrap());
        assert_eq!(b.path, pd_bridge_core::block::block_path(&dir, &b.hash));
        assert!(!b.existed);
        let info = b.check.as_ref().expect("a block the writer wrote validates");
        assert_eq!((info.hash, info.token_count, info.model_name.as_str()), (b.hash, BLOCK, "/m"));
        assert_eq!(info.file_size, std::fs::metadata(&b.path).unwrap().len());
    }

    // The same blocks as a direct write from a full cache.
    let direct = temp_dir("direct");
    let wd = BlockWriter::new(&direct, "/m", BLOCK, &tokens).unwrap();
    let mut full = CacheBuilder::new(w.clone(), DecoderSteps::new(BLOCK).unwrap());
    let hidden = w.plan.hidden_size();
    for k in 0..5 {
        for (l, x) in inputs.iter().enumerate() {
            full.feed(l, k * BLOCK, &x[k * BLOCK * hidden..(k + 1) * BLOCK * hidden]).unwrap();
        }
        let a = wd.write(k, full.layers()).unwrap().path;
        wd.flush().unwrap();
        let b = pd_bridge_core::block::block_path(&dir, writer.hash(k).unwrap());
        common::assert_same_block(&a, &b);
    }
}

#[test]
fn wrong_token_gets_nothing() {
    let prompt = 2 * BLOCK;
    let (w, inputs, tokens) = setup(prompt);
    let server = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(5)).unwrap();
    let producer = prefill(&server, w.clone(), inputs, prompt, None);
    let dir = temp_dir("wrongtok");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let got = pull(&server, b"nope", "req", &w, &tokens, &writer, Duration::from_secs(5), &IngestControl::default(), |_| {});
    producer.join().unwrap();
    assert_eq!(got.blocks, 0);
    let err = got.outcome.unwrap_err().to_string();
    assert!(err.contains("refused") && err.contains("unauthorized"), "{err}");
    assert!(common::files_under(&dir).is_empty());
}

#[test]
fn prefill_dying_mid_stream_leaves_a_valid_prefix() {
    let prompt = 6 * BLOCK;
    let (w, inputs, tokens) = setup(prompt);
    let server = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_millis(700)).unwrap();
    let producer = prefill(&server, w.clone(), inputs, prompt, Some(300));
    let dir = temp_dir("dying");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let got = pull(&server, b"tok", "req", &w, &tokens, &writer, Duration::from_secs(10), &IngestControl::default(), |_| {});
    producer.join().unwrap();
    assert!(matches!(got.outcome, Err(CoreError::Wire(_))), "{:?}", got.outcome);
    assert_eq!(got.blocks, 2);
    let files = common::files_under(&dir);
    assert_eq!(files.len(), 2, "{files:?}");
    let expect = Expect { model_name: Some("/m".into()), num_layers: Some(3), block_size: Some(BLOCK), ..Default::default() };
    for f in files {
        inspect(&f, &expect).unwrap();
    }
}

/// A prefill host that goes silent mid-stream (no segment, no seal, the connection open): the
/// decode host gives up at its own idle deadline and says so, not "os error 11".
#[test]
fn a_silent_prefill_host_is_named_as_silent() {
    let prompt = 6 * BLOCK;
    let (w, inputs, tokens) = setup(prompt);
    let server = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(30)).unwrap();
    let producer = prefill(&server, w.clone(), inputs, prompt, Some(300));
    let dir = temp_dir("silent");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let got = pull(&server, b"tok", "req", &w, &tokens, &writer, Duration::from_millis(800), &IngestControl::default(), |_| {});
    producer.join().unwrap();
    assert_eq!(got.blocks, 2);
    let err = got.outcome.unwrap_err().to_string();
    assert!(err.contains("the prefill host sent nothing for 800ms (the decode host's idle deadline)"), "{err}");
    assert!(!err.contains("os error"), "{err}");
}

#[test]
fn an_unread_outbox_is_bounded_by_the_memory_bound() {
    let prompt = 2 * BLOCK;
    let (w, inputs, _) = setup(prompt);
    let hidden = w.plan.hidden_size();
    let mut cap = Capture::new(w.clone(), "nobody-reads", prompt, BLOCK).unwrap();
    for (l, x) in inputs.iter().enumerate() {
        cap.feed(l, 0, &x[..BLOCK * hidden]).unwrap();
    }
    let seg = cap.take_ready().pop().unwrap();
    let bytes = pd_bridge_core::wire::segment_payload_len(&seg);
    let config = ServerConfig { memory_bound: 3 * bytes + bytes / 2, ..ServerConfig::default() };
    let server = SegmentServer::bind_with("127.0.0.1:0", b"tok".to_vec(), config).unwrap();
    let outbox = server.outbox("nobody-reads", &secret(), &w.fingerprint, &PromptDigest::of(&[])).unwrap();
    let accepted = (0..8).filter(|_| outbox.push(seg.clone())).count();
    assert_eq!(accepted, 3, "three segments fit the bound, the fourth crosses it");
    assert!(outbox.is_closed());
    assert_eq!(outbox.queued_bytes(), 0, "a dropped stream holds nothing");
}

#[test]
fn a_step_that_completes_a_hundred_blocks_at_once_streams_them_all() {
    // The whole prompt in one step (vLLM's CPU backend without chunked prefill, or a long
    // chunk of small blocks): every block completes at the last layer's feed, far more at once
    // than a decode host reads in that time; the stream must carry them all.
    let prompt = 100 * BLOCK;
    let (w, inputs, tokens) = setup(prompt);
    let server = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(60)).unwrap();
    let producer = prefill_in_chunks(&server, w.clone(), inputs, prompt, None, prompt);
    let dir = temp_dir("one-step");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let got = pull(&server, b"tok", "req", &w, &tokens, &writer, Duration::from_secs(60), &IngestControl::default(), |_| {});
    producer.join().unwrap();
    assert_eq!(got.outcome.unwrap(), Seal::Complete { blocks: 100, tokens: prompt as u64 });
    assert_eq!(got.blocks, 100);
}

#[test]
fn a_cancelled_ingest_returns_at_once_and_keeps_whole_blocks() {
    let prompt = 6 * BLOCK;
    let (w, inputs, tokens) = setup(prompt);
    // The prefill stalls after two blocks; the server would wait 30 s for more.
    let server =
        SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(30)).unwrap();
    let producer = prefill(&server, w.clone(), inputs, prompt, Some(300));
    let dir = temp_dir("cancel");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let control = Arc::new(IngestControl::default());
    let canceller = {
        let control = control.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            control.cancel();
        })
    };
    let t0 = std::time::Instant::now();
    let got = pull(&server, b"tok", "req", &w, &tokens, &writer, Duration::from_secs(30), &control, |_| {});
    canceller.join().unwrap();
    producer.join().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "cancel did not interrupt the read: {:?}",
        t0.elapsed()
    );
    match &got.outcome {
        Err(CoreError::Wire(m)) => assert!(m.contains("cancelled"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(got.blocks, 2);
    for f in common::files_under(&dir) {
        inspect(&f, &Expect::default()).unwrap();
    }
    // Cancelled before connecting: nothing happens.
    let again = pull(&server, b"tok", "other", &w, &tokens, &writer, Duration::from_secs(30), &control, |_| {});
    assert_eq!(again.blocks, 0);
    assert!(again.outcome.is_err());
}

/// One capture over four lanes: the same blocks, in chain order, as over one stream; the
/// server's memory and outboxes back to zero after.
#[test]
fn a_capture_over_four_lanes_lands_the_same_blocks_in_order() {
    let prompt = 9 * BLOCK + 37;
    let (w, inputs, tokens) = setup(prompt);
    let one = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(20)).unwrap();
    let producer = prefill(&one, w.clone(), inputs.clone(), prompt, None);
    let dir1 = temp_dir("lanes-one");
    let w1 = BlockWriter::new(&dir1, "/m", BLOCK, &tokens).unwrap();
    let got1 = pull(&one, b"tok", "req", &w, &tokens, &w1, Duration::from_secs(20), &IngestControl::default(), |_| {});
    producer.join().unwrap();
    assert_eq!(got1.outcome.unwrap(), Seal::Complete { blocks: 9, tokens: 9 * BLOCK as u64 });

    let four = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(20)).unwrap();
    // Small chunks: segments complete one by one while the lanes read.
    let producer = prefill_in_chunks(&four, w.clone(), inputs, prompt, None, 50);
    let dir4 = temp_dir("lanes-four");
    let w4 = BlockWriter::new(&dir4, "/m", BLOCK, &tokens).unwrap();
    let mut order = vec![];
    let got4 = pull_lanes(4, &four, b"tok", "req", &w, &tokens, &w4, Duration::from_secs(20), &IngestControl::default(), |b| order.push(b.index));
    producer.join().unwrap();
    assert_eq!(got4.outcome.unwrap(), Seal::Complete { blocks: 9, tokens: 9 * BLOCK as u64 });
    assert_eq!(order, (0..9).collect::<Vec<_>>());
    for k in 0..9 {
        let a = pd_bridge_core::block::block_path(&dir1, w1.hash(k).unwrap());
        let b = pd_bridge_core::block::block_path(&dir4, w4.hash(k).unwrap());
        common::assert_same_block(&a, &b);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while four.outboxes() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!((four.outboxes(), four.queued_bytes(), four.accounting_faults()), (0, 0, 0));
}

/// A capture that dies mid-stream over three lanes: the blocks before the gap are written, whole
/// and in order, and nothing after it.
#[test]
fn a_capture_dying_over_three_lanes_keeps_an_ordered_prefix() {
    let prompt = 6 * BLOCK;
    let (w, inputs, tokens) = setup(prompt);
    let server = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_millis(700)).unwrap();
    let producer = prefill(&server, w.clone(), inputs, prompt, Some(300));
    let dir = temp_dir("lanes-dying");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let mut order = vec![];
    let got = pull_lanes(3, &server, b"tok", "req", &w, &tokens, &writer, Duration::from_secs(10), &IngestControl::default(), |b| order.push(b.index));
    producer.join().unwrap();
    assert!(matches!(got.outcome, Err(CoreError::Wire(_))), "{:?}", got.outcome);
    assert_eq!(order, vec![0, 1]);
    let expect = Expect { model_name: Some("/m".into()), num_layers: Some(3), block_size: Some(BLOCK), ..Default::default() };
    for f in common::files_under(&dir) {
        inspect(&f, &expect).unwrap();
    }
}

/// A cancel stops every lane at once (each would otherwise wait for its idle deadline).
#[test]
fn a_cancel_stops_every_lane() {
    let prompt = 4 * BLOCK;
    let (w, _, tokens) = setup(prompt);
    let server = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(60)).unwrap();
    // Registered, never fed: every lane waits.
    let _outbox = server.outbox("req", &secret(), &w.fingerprint, &PromptDigest::of(&tokens)).unwrap();
    let control = Arc::new(IngestControl::default());
    let c = control.clone();
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        c.cancel();
    });
    let dir = temp_dir("lanes-cancel");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let t = std::time::Instant::now();
    let got = pull_lanes(4, &server, b"tok", "req", &w, &tokens, &writer, Duration::from_secs(30), &control, |_| {});
    canceller.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "took {:?}", t.elapsed());
    assert!(got.outcome.unwrap_err().to_string().contains("cancelled by the decode host"));
    assert_eq!(got.blocks, 0);
}
