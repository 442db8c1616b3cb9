//! Pipeline stages over loopback TCP: each stage captures its own layers and serves them on the
//! base port + its stage; the decode host pulls every stage and writes whole blocks, the same as
//! from one capture of every layer. A stage that fails ends the capture there, naming the stage,
//! and no block is written without every layer.

mod common;

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use pd_bridge_core::block::validate::{inspect, Expect};
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::capture::Capture;
use pd_bridge_core::ingest::{ingest, IngestControl, Ingested, Pull};
use pd_bridge_core::segment_server::SegmentServer;
use pd_bridge_core::wire::{CaptureSecret, FrameLimits, PromptDigest, Seal};
use pd_bridge_core::DecoderWeights;

use common::{random_rows, temp_dir, v4_model_dir, Rng};

const BLOCK: usize = 128;

fn secret() -> CaptureSecret {
    CaptureSecret::from_hex(&"7a".repeat(32)).unwrap()
}

/// `n` segment servers on consecutive ports (as one vLLM with `n` pipeline stages has them).
fn servers(n: usize) -> Vec<SegmentServer> {
    'again: loop {
        let first = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(20)).unwrap();
        let base = first.local_addr().port();
        let mut all = vec![first];
        for s in 1..n {
            match base.checked_add(s as u16).map(|p| SegmentServer::bind(&format!("127.0.0.1:{p}"), b"tok".to_vec(), Duration::from_secs(20))) {
                Some(Ok(srv)) => all.push(srv),
                _ => continue 'again,
            }
        }
        return all;
    }
}

/// One stage's prefill on its own thread: a capture of `layers` only, fed in 100-token chunks;
/// `die_at`: seal it aborted there (its worker died).
fn stage(server: &SegmentServer, w: Arc<DecoderWeights>, inputs: Arc<Vec<Vec<half::bf16>>>, prompt: usize, layers: Range<usize>, die_at: Option<usize>) -> std::thread::JoinHandle<()> {
    let tokens: Vec<u32> = (0..prompt as u32).collect();
    let outbox = server.outbox("req", &secret(), &w.fingerprint, &PromptDigest::of(&tokens)).unwrap();
    std::thread::spawn(move || {
        let hidden = w.plan.hidden_size();
        let whole = layers == (0..w.plan.num_layers());
        let mut cap = Capture::new(w.clone(), "req", prompt, BLOCK).unwrap();
        if !whole {
            cap = cap.for_stage(layers.clone()).unwrap();
        }
        let mut start = 0;
        while start < prompt {
            if die_at.is_some_and(|d| start >= d) {
                outbox.seal(cap.seal(Some("its worker process died")));
                return;
            }
            let end = (start + 100).min(prompt);
            for l in layers.clone() {
                cap.feed(l, start, &inputs[l][start * hidden..end * hidden]).unwrap();
            }
            for seg in cap.take_ready() {
                outbox.push(seg);
            }
            start = end;
        }
        outbox.seal(cap.seal(None));
    })
}

fn pull(addr: SocketAddr, stages: u8, w: &DecoderWeights, tokens: &[u32], writer: &BlockWriter, on_block: impl FnMut(&pd_bridge_core::block::Landed)) -> Ingested {
    let s = secret();
    let p = Pull {
        addrs: vec![addr],
        token: b"tok",
        secret: &s,
        request_id: "req",
        fingerprint: &w.fingerprint,
        prompt: PromptDigest::of(tokens),
        limits: FrameLimits::for_plan(&w.plan, writer.format(), BLOCK),
        timeout: Duration::from_secs(20),
        lanes: 1,
        stages,
    };
    ingest(&p, writer, &IngestControl::default(), on_block)
}

fn setup(prompt: usize) -> (Arc<DecoderWeights>, Arc<Vec<Vec<half::bf16>>>, Vec<u32>) {
    let w = Arc::new(DecoderWeights::load(v4_model_dir(41)).unwrap());
    let mut rng = Rng::new(5);
    let inputs = (0..w.plan.num_layers()).map(|_| random_rows(&mut rng, prompt, w.plan.hidden_size())).collect();
    (w, Arc::new(inputs), (0..prompt as u32).collect())
}

#[test]
fn pipeline_stages_join_into_the_blocks_of_one_capture() {
    let prompt = 5 * BLOCK + 37;
    let (w, inputs, tokens) = setup(prompt);
    let layers = w.plan.num_layers();
    assert_eq!(layers, 3);

    let one = servers(1);
    let producer = stage(&one[0], w.clone(), inputs.clone(), prompt, 0..layers, None);
    let dir1 = temp_dir("stages-one");
    let w1 = BlockWriter::new(&dir1, "/m", BLOCK, &tokens).unwrap();
    let got1 = pull(one[0].local_addr(), 1, &w, &tokens, &w1, |_| {});
    producer.join().unwrap();
    assert_eq!(got1.outcome.unwrap(), Seal::Complete { blocks: 5, tokens: 5 * BLOCK as u64 });

    // Two stages (layer 0; layers 1 and 2), then three (one layer each).
    for ranges in [vec![0..1, 1..3], vec![0..1, 1..2, 2..3]] {
        let srv = servers(ranges.len());
        let producers: Vec<_> = srv.iter().zip(&ranges).map(|(s, r)| stage(s, w.clone(), inputs.clone(), prompt, r.clone(), None)).collect();
        let dir = temp_dir("stages");
        let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
        let mut order = vec![];
        let got = pull(srv[0].local_addr(), ranges.len() as u8, &w, &tokens, &writer, |b| order.push(b.index));
        for p in producers {
            p.join().unwrap();
        }
        assert_eq!(got.outcome.unwrap(), Seal::Complete { blocks: 5, tokens: 5 * BLOCK as u64 }, "{ranges:?}");
        assert_eq!(order, vec![0, 1, 2, 3, 4]);
        for k in 0..5 {
            common::assert_same_block(&pd_bridge_core::block::block_path(&dir1, w1.hash(k).unwrap()), &pd_bridge_core::block::block_path(&dir, writer.hash(k).unwrap()));
        }
        for s in &srv {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while s.outboxes() > 0 && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            assert_eq!((s.outboxes(), s.queued_bytes(), s.accounting_faults()), (0, 0, 0));
        }
    }
}

#[test]
fn a_stage_that_dies_ends_the_capture_there_naming_it() {
    let prompt = 6 * BLOCK;
    let (w, inputs, tokens) = setup(prompt);
    let srv = servers(2);
    let first = stage(&srv[0], w.clone(), inputs.clone(), prompt, 0..1, None);
    let second = stage(&srv[1], w.clone(), inputs.clone(), prompt, 1..3, Some(300));
    let dir = temp_dir("stages-dying");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let mut order = vec![];
    let got = pull(srv[0].local_addr(), 2, &w, &tokens, &writer, |b| order.push(b.index));
    first.join().unwrap();
    second.join().unwrap();
    assert_eq!(got.outcome.unwrap(), Seal::Aborted { blocks: 2, reason: "pipeline stage 2 of 2: its worker process died".into() });
    assert_eq!((got.blocks, order), (2, vec![0, 1]));
    // Every block written holds every layer.
    let expect = Expect { model_name: Some("/m".into()), num_layers: Some(3), block_size: Some(BLOCK), ..Default::default() };
    let files = common::files_under(&dir);
    assert_eq!(files.len(), 2);
    for f in files {
        inspect(&f, &expect).unwrap();
    }
}

#[test]
fn a_stage_nobody_serves_and_a_pull_unaware_of_stages_write_nothing() {
    let prompt = 2 * BLOCK;
    let (w, inputs, tokens) = setup(prompt);
    let srv = servers(2);
    let first = stage(&srv[0], w.clone(), inputs.clone(), prompt, 0..1, None);
    let second = stage(&srv[1], w.clone(), inputs.clone(), prompt, 1..3, None);
    // Three stages asked of a host that runs two: the third cannot be reached.
    let dir = temp_dir("stages-missing");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let got = pull(srv[0].local_addr(), 3, &w, &tokens, &writer, |_| {});
    let e = got.outcome.unwrap_err().to_string();
    assert!(e.contains("pipeline stage 3 of 3") && e.contains("cannot reach the prefill host"), "{e}");
    assert_eq!(got.blocks, 0);
    for p in [first, second] {
        p.join().unwrap();
    }
    // A decode host that does not know of the stages pulls stage 2 alone: refused, saying why.
    let srv = servers(2);
    let second = stage(&srv[1], w.clone(), inputs, prompt, 1..3, None);
    let dir = temp_dir("stages-unaware");
    let writer = BlockWriter::new(&dir, "/m", BLOCK, &tokens).unwrap();
    let got = pull(srv[1].local_addr(), 1, &w, &tokens, &writer, |_| {});
    second.join().unwrap();
    let e = got.outcome.unwrap_err().to_string();
    assert!(e.contains("one pipeline stage's part of a block") && e.contains("PD_BRIDGE_PREFILL_PP"), "{e}");
    assert_eq!(got.blocks, 0);
    assert!(common::files_under(&dir).is_empty());
}
