//! Resumed == one-shot (issue 13): a capture resumed at a block boundary `S` from the decoder's
//! carry state there — taken from the pooler's state or read back from the block file the core's
//! own writer wrote — emits exactly the segments of a one-shot capture from `S` on, seals the
//! same, and ends in the same cache state, for random resume points on the block grid, random
//! chunkings and feeds that start before `S` (rows the carry state already holds). A carry state
//! for other weights, another format, block size or position is refused, naming what.

mod common;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use half::bf16;
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::capture::Capture;
use pd_bridge_core::pooler::carry::{CarryState, LayerCarry};
use pd_bridge_core::error::CarryField;
use pd_bridge_core::segment::Segment;
use pd_bridge_core::wire::Seal;
use pd_bridge_core::{CacheBuilder, CoreError, DecoderSteps, DecoderWeights, OmlxFormat, StateArray};
use proptest::prelude::*;

use common::{mla_model_dir, random_rows, temp_dir, v4_model_dir, Rng};

const UP: OmlxFormat = OmlxFormat::Upstream063;
const FORK: OmlxFormat = OmlxFormat::Fork070;

fn v4() -> Arc<DecoderWeights> {
    static W: OnceLock<Arc<DecoderWeights>> = OnceLock::new();
    W.get_or_init(|| Arc::new(DecoderWeights::load(v4_model_dir(41)).unwrap())).clone()
}

fn mla() -> Arc<DecoderWeights> {
    static W: OnceLock<Arc<DecoderWeights>> = OnceLock::new();
    W.get_or_init(|| Arc::new(DecoderWeights::load(mla_model_dir(42)).unwrap())).clone()
}

fn inputs(w: &DecoderWeights, tokens: usize, seed: u64) -> Vec<Vec<bf16>> {
    let mut rng = Rng::new(seed);
    (0..w.plan.num_layers()).map(|_| random_rows(&mut rng, tokens, w.plan.hidden_size())).collect()
}

/// What a capture produced: its segments, its seal, and every layer's final state.
#[derive(Debug, PartialEq)]
struct Outcome {
    segments: Vec<Segment>,
    seal: Seal,
    state: Vec<Vec<StateArray>>,
}

/// Feed tokens `[from, prompt)` cut at `cuts` (each chunk to every layer in turn, as a prefill
/// engine does), then seal.
fn drive(mut cap: Capture, x: &[Vec<bf16>], hidden: usize, prompt: usize, from: usize, cuts: &[usize]) -> Outcome {
    let mut bounds: Vec<usize> = cuts.iter().copied().filter(|&c| c > from && c < prompt).collect();
    bounds.sort();
    bounds.dedup();
    bounds.push(prompt);
    let mut segments = Vec::new();
    let mut start = from;
    for end in bounds {
        for (l, rows) in x.iter().enumerate() {
            cap.feed(l, start, &rows[start * hidden..end * hidden]).unwrap();
        }
        segments.extend(cap.take_ready());
        start = end;
    }
    let seal = cap.seal(None);
    segments.extend(cap.take_ready());
    let state = cap.layer_states().iter().map(|l| l.snapshot()).collect();
    Outcome { segments, seal, state }
}

/// The decoder's blocks up to `s`, written by the core's block writer from a full cache, and the
/// carry state at `s` straight from that cache.
fn decoder_side(w: &Arc<DecoderWeights>, format: OmlxFormat, block: usize, x: &[Vec<bf16>], s: usize) -> (PathBuf, CarryState) {
    let hidden = w.plan.hidden_size();
    let tokens: Vec<u32> = (0..s as u32).map(|t| t * 7 + 1).collect();
    let dir = temp_dir("resume-blocks");
    let writer = BlockWriter::with_format(format, &dir, "tiny", block, &tokens).unwrap();
    let mut full = CacheBuilder::new(w.clone(), DecoderSteps::for_format(format, block).unwrap());
    let mut last = None;
    for k in 0..s / block {
        for (l, rows) in x.iter().enumerate() {
            full.feed(l, k * block, &rows[k * block * hidden..(k + 1) * block * hidden]).unwrap();
        }
        last = Some(writer.write(k, full.layers()).unwrap().path);
    }
    writer.flush().unwrap();
    let hash = writer.hash(s / block - 1).copied();
    let carry = CarryState::from_layers(format, &w.fingerprint, block, hash, full.layers()).unwrap();
    (last.unwrap(), carry)
}

/// One case: one-shot vs resumed at `s` from the block file's carry state (which must equal the
/// in-memory one and survive its own bytes), the resumed feed starting `lead` tokens before `s`.
fn check(w: &Arc<DecoderWeights>, format: OmlxFormat, block: usize, prompt: usize, s: usize, lead: usize, cuts: &[usize], seed: u64) -> std::result::Result<(), TestCaseError> {
    let hidden = w.plan.hidden_size();
    let x = inputs(w, prompt, seed);
    let one = drive(Capture::with_format(format, w.clone(), "req", prompt, block).unwrap(), &x, hidden, prompt, 0, cuts);
    prop_assert!(matches!(one.seal, Seal::Complete { .. }), "one-shot seal {:?}", one.seal);

    let (path, from_state) = decoder_side(w, format, block, &x, s);
    let from_file = CarryState::from_block_file(&path, &w.plan, &w.fingerprint, format, block, s).unwrap();
    prop_assert_eq!(&from_file, &from_state, "the block file's carry state is the cache's");
    let carry = CarryState::decode(&from_file.encode()).unwrap();
    prop_assert_eq!(&carry, &from_file);

    let cap = Capture::resume(format, w.clone(), "req", prompt, block, &carry).unwrap();
    prop_assert_eq!(cap.resumed_at(), s);
    let resumed = drive(cap, &x, hidden, prompt, s - lead.min(s), cuts);
    let tail: Vec<Segment> = one.segments.iter().filter(|g| g.header.index as usize >= s / block).cloned().collect();
    prop_assert_eq!(resumed.segments.len(), prompt / block - s / block);
    prop_assert_eq!(&resumed.segments, &tail);
    prop_assert_eq!(&resumed.seal, &one.seal);
    prop_assert_eq!(&resumed.state, &one.state);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, .. ProptestConfig::default() })]

    /// Blocks of 64 and 128 (multiples of both ratios) and 100 (a ratio-4 and a ratio-128
    /// remainder cross every boundary); the tiny model's window is 8 rows.
    #[test]
    fn v4_resumed_equals_one_shot(format in prop::sample::select(vec![UP, UP, FORK]), block in prop::sample::select(vec![64usize, 100, 128]),
                                  resume_block in 1usize..5, tail in 0usize..400, lead in 0usize..700,
                                  cuts in prop::collection::vec(0usize..1000, 0..8), seed in 0u64..1000) {
        let s = resume_block * block;
        check(&v4(), format, block, s + tail, s, lead, &cuts, seed)?;
    }

    #[test]
    fn mla_resumed_equals_one_shot(format in prop::sample::select(vec![UP, FORK]), block in prop::sample::select(vec![16usize, 64]),
                                   resume_block in 1usize..6, tail in 0usize..200, lead in 0usize..400,
                                   cuts in prop::collection::vec(0usize..600, 0..8), seed in 0u64..1000) {
        let s = resume_block * block;
        check(&mla(), format, block, s + tail, s, lead, &cuts, seed)?;
    }
}

#[test]
fn v4_single_token_chunks_across_the_resume_point() {
    let w = v4();
    let cuts: Vec<usize> = (200..330).collect();
    check(&w, UP, 128, 400, 256, 60, &cuts, 5).unwrap();
    check(&w, UP, 100, 333, 200, 200, &[], 6).unwrap();
}

/// The carry state really carries something: at a boundary inside a ratio-4 and a ratio-128
/// window (block 100), the remainders and the upstream previous window are not empty, and
/// resuming without them (as if from a fresh capture) gives other pools.
#[test]
fn carried_remainders_and_previous_window_matter() {
    let w = v4();
    let (block, s, prompt) = (100, 300, 520);
    let x = inputs(&w, prompt, 8);
    let (_, carry) = decoder_side(&w, UP, block, &x, s);
    let LayerCarry::V4(ratio4) = &carry.layers[1] else { panic!("layer 1 is ratio 4") };
    let LayerCarry::V4(ratio128) = &carry.layers[2] else { panic!("layer 2 is ratio 128") };
    assert_eq!((ratio4.ratio, ratio128.ratio), (4, 128));
    assert!(ratio4.pools.iter().all(|p| p.prev.is_some() && p.buf_kv.is_empty()), "300 % 4 == 0: no remainder, a previous window");
    assert_eq!(ratio128.pools[0].buf_kv.len(), (300 % 128) * 16);
    let hidden = w.plan.hidden_size();
    let good = drive(Capture::resume(UP, w.clone(), "req", prompt, block, &carry).unwrap(), &x, hidden, prompt, s, &[]);
    let mut hollow = carry.clone();
    for l in hollow.layers.iter_mut() {
        if let LayerCarry::V4(c) = l {
            for p in c.pools.iter_mut() {
                p.buf_kv.iter_mut().chain(p.buf_gate.iter_mut()).for_each(|v| *v = bf16::ZERO);
                if let Some([k, g]) = p.prev.as_mut() {
                    k.iter_mut().chain(g.iter_mut()).for_each(|v| *v = bf16::ZERO);
                }
            }
        }
    }
    let bad = drive(Capture::resume(UP, w.clone(), "req", prompt, block, &hollow).unwrap(), &x, hidden, prompt, s, &[]);
    assert_eq!(good.segments.len(), bad.segments.len());
    // The pooled rows the segments ship, per layer (the windows straddling S are in the first).
    let pooled = |o: &Outcome, l: usize| -> Vec<bf16> {
        o.segments
            .iter()
            .flat_map(|g| match &g.views().unwrap()[l] {
                pd_bridge_core::view::LayerView::V4(v) => v.pools.iter().flat_map(|p| p[2].data.to_vec()).collect::<Vec<_>>(),
                _ => panic!("a V4 layer"),
            })
            .collect()
    };
    for l in [1, 2] {
        assert!(!pooled(&good, l).is_empty());
        assert_ne!(pooled(&good, l), pooled(&bad, l), "layer {l}");
    }
    assert_eq!(pooled(&good, 0), pooled(&bad, 0));
}

fn what(e: CoreError) -> CarryField {
    match e {
        CoreError::Carry { what, .. } => what,
        other => panic!("expected a carry-state error, got {other}"),
    }
}

#[test]
fn mismatched_carry_states_are_refused_by_name() {
    let w = v4();
    let (block, s, prompt) = (128, 256, 600);
    let x = inputs(&w, prompt, 11);
    let (path, carry) = decoder_side(&w, UP, block, &x, s);
    let resume = |c: &CarryState, f: OmlxFormat, b: usize, p: usize| Capture::resume(f, w.clone(), "r", p, b, c).map(|_| ());

    let mut other = carry.clone();
    other.fingerprint = "sha256:00".into();
    let e = resume(&other, UP, block, prompt).unwrap_err();
    assert!(e.to_string().contains("sha256:00"), "{e}");
    assert_eq!(what(e), CarryField::Fingerprint);
    assert_eq!(what(resume(&carry, FORK, block, prompt).unwrap_err()), CarryField::Format);
    assert_eq!(what(resume(&carry, UP, 64, prompt).unwrap_err()), CarryField::BlockSize);
    // Past the prompt's full blocks (the prompt would end inside the carried prefix).
    assert_eq!(what(resume(&carry, UP, block, 200).unwrap_err()), CarryField::Position);
    // A carry state claiming another position than its arrays hold.
    let mut shifted = carry.clone();
    shifted.position += block;
    let e = resume(&shifted, UP, block, prompt).unwrap_err();
    assert!(e.to_string().contains("pooled rows"), "{e}");
    assert_eq!(what(e), CarryField::Position);
    shifted.position = 200;
    assert_eq!(what(resume(&shifted, UP, block, prompt).unwrap_err()), CarryField::Position);
    // Other layers: the MLA model's carry state stamped with the V4 fingerprint.
    let m = mla();
    let (_, mla_carry) = decoder_side(&m, UP, 64, &inputs(&m, 128, 1), 128);
    let mut foreign = mla_carry.clone();
    foreign.fingerprint = w.fingerprint.clone();
    assert_eq!(what(resume(&foreign, UP, 64, prompt).unwrap_err()), CarryField::Plan);

    // Read from the file: the block at `s` is not the block at another position, and not a
    // block of another format.
    let e = CarryState::from_block_file(&path, &w.plan, &w.fingerprint, UP, block, s + block).unwrap_err();
    assert!(e.to_string().contains("ends at token Some(256), not 384"), "{e}");
    assert_eq!(what(e), CarryField::Position);
    assert_eq!(what(CarryState::from_block_file(&path, &w.plan, &w.fingerprint, FORK, block, s).unwrap_err()), CarryField::Block);
    assert_eq!(what(CarryState::from_block_file(&path, &m.plan, &m.fingerprint, UP, block, s).unwrap_err()), CarryField::Block);
    // Damaged bytes never reach a capture.
    let mut bytes = carry.encode();
    let n = bytes.len();
    bytes[n / 2] ^= 0x40;
    assert_eq!(what(CarryState::decode(&bytes).unwrap_err()), CarryField::Framing);
}

#[test]
fn rows_before_the_resume_point_are_ignored_and_a_gap_is_refused() {
    let w = v4();
    let (block, s, prompt) = (128, 256, 520);
    let hidden = w.plan.hidden_size();
    let x = inputs(&w, prompt, 12);
    let (_, carry) = decoder_side(&w, UP, block, &x, s);
    let mut cap = Capture::resume(UP, w.clone(), "r", prompt, block, &carry).unwrap();
    // Wholly before S: nothing happens, even fed twice.
    for _ in 0..2 {
        for (l, rows) in x.iter().enumerate() {
            cap.feed(l, 0, &rows[..200 * hidden]).unwrap();
        }
    }
    assert!(cap.take_ready().is_empty());
    assert!(cap.layer_states().iter().all(|l| l.processed() == s));
    // Rows after S that were never fed are a gap, refused naming the resume point.
    let e = cap.feed(0, s + 10, &x[0][(s + 10) * hidden..(s + 20) * hidden]).unwrap_err().to_string();
    assert!(e.contains("resumed at 256") && e.contains("[256, 266)"), "{e}");

    // A capture created first and seeded afterwards is the same capture; once fed, never.
    let mut late = Capture::with_format(UP, w.clone(), "r", prompt, block).unwrap();
    late.resume_at(&carry).unwrap();
    let direct = Capture::resume(UP, w.clone(), "r", prompt, block, &carry).unwrap();
    assert_eq!(drive(late, &x, hidden, prompt, 0, &[300]), drive(direct, &x, hidden, prompt, 0, &[300]));
    let mut fed = Capture::with_format(UP, w.clone(), "r", prompt, block).unwrap();
    fed.feed(0, 0, &x[0][..hidden]).unwrap();
    let e = fed.resume_at(&carry).unwrap_err().to_string();
    assert!(e.contains("already fed"), "{e}");

    // Resuming at the prompt's last full block leaves nothing to capture: complete at once.
    let (_, at_end) = decoder_side(&w, UP, block, &x, 512);
    let mut done = Capture::resume(UP, w.clone(), "r", prompt, block, &at_end).unwrap();
    for (l, rows) in x.iter().enumerate() {
        done.feed(l, 0, &rows[..prompt * hidden]).unwrap();
    }
    assert!(done.take_ready().is_empty());
    assert_eq!(done.seal(None), Seal::Complete { blocks: 4, tokens: 512 });
}

/// The carry state's size, printed (not asserted): what the decode host sends per resume.
#[test]
fn carry_state_size() {
    for (name, w, block) in [("v4 tiny (ratios 0/4/128, window 8)", v4(), 128), ("mla tiny", mla(), 64)] {
        let x = inputs(&w, 2 * block, 3);
        let (_, carry) = decoder_side(&w, UP, block, &x, 2 * block);
        let bytes = carry.encode();
        println!("carry state, {name}, at {}: {} bytes", 2 * block, bytes.len());
        assert_eq!(CarryState::decode(&bytes).unwrap(), carry);
    }
}

/// The decode side takes a resumed stream (upstream format): a writer resumed from the same carry
/// state admits the stream from block `S / block` with pool deltas from the carried rows, and
/// writes the same block files as writing the whole prompt directly. Without the resume, or from
/// a carry state of another prefix or format, it refuses.
#[test]
fn resumed_stream_writes_the_blocks_of_the_whole_prompt() {
    use pd_bridge_core::wire::{send_seal, send_segment, Event, SegmentReader};
    // MLA has no pools, so the fork's format resumes too.
    for (w, f, block, s, prompt) in [(v4(), UP, 100, 300, 777), (v4(), UP, 128, 256, 700), (mla(), UP, 64, 128, 400), (mla(), FORK, 64, 128, 400)] {
        let hidden = w.plan.hidden_size();
        let x = inputs(&w, prompt, 21);
        let tokens: Vec<u32> = (0..prompt as u32).map(|t| t * 7 + 1).collect();
        // Direct: every block of the prompt from a full cache.
        let direct = temp_dir("resume-direct");
        let wd = BlockWriter::with_format(f, &direct, "tiny", block, &tokens).unwrap();
        let mut full = CacheBuilder::new(w.clone(), DecoderSteps::for_format(f, block).unwrap());
        let mut paths = Vec::new();
        for k in 0..prompt / block {
            for (l, rows) in x.iter().enumerate() {
                full.feed(l, k * block, &rows[k * block * hidden..(k + 1) * block * hidden]).unwrap();
            }
            paths.push(wd.write(k, full.layers()).unwrap().path);
        }
        wd.flush().unwrap();

        // The decoder holds the blocks before S; the prefill host resumes from their carry state.
        let (held, _) = decoder_side(&w, f, block, &x, s);
        let carry = CarryState::from_block_file(&held, &w.plan, &w.fingerprint, f, block, s).unwrap();
        let cap = Capture::resume(f, w.clone(), "req", prompt, block, &carry).unwrap();
        let out = drive(cap, &x, hidden, prompt, 0, &[s + 3, s + block + 1]);
        let mut wire = Vec::new();
        for seg in &out.segments {
            send_segment(&mut wire, seg).unwrap();
        }
        send_seal(&mut wire, &out.seal).unwrap();

        // A writer that does not know the stream resumed refuses its first segment.
        let fresh = BlockWriter::with_format(f, temp_dir("resume-fresh"), "tiny", block, &tokens).unwrap().with_plan(&w.plan).unwrap();
        let e = fresh.write_segment(&out.segments[0]).unwrap_err().to_string();
        assert!(e.contains("block"), "{e}");

        let dir = temp_dir("resume-streamed");
        let ws = BlockWriter::with_format(f, &dir, "tiny", block, &tokens).unwrap().with_plan(&w.plan).unwrap();
        ws.resume_at(&carry).unwrap();
        assert_eq!(ws.next_block(), s / block);
        let mut reader = SegmentReader::new(&wire[..], "req", &w.fingerprint).starting_at((s / block) as u32, s as u64);
        let mut written = 0;
        loop {
            match reader.next_event().unwrap() {
                Event::Segment(seg) => {
                    let p = ws.write_segment(&seg).unwrap().path;
                    ws.flush().unwrap();
                    common::assert_same_block(&p, &paths[seg.header.index as usize]);
                    written += 1;
                }
                Event::Seal(seal) => {
                    assert_eq!(seal, Seal::Complete { blocks: (prompt / block) as u32, tokens: (prompt / block * block) as u64 });
                    break;
                }
            }
        }
        assert_eq!(written, prompt / block - s / block);
        // Once a segment was admitted, no resume; a carry state of another prefix, never.
        assert!(ws.resume_at(&carry).is_err());
        let other: Vec<u32> = tokens.iter().map(|t| t + 1).collect();
        let wo = BlockWriter::with_format(f, temp_dir("resume-other"), "tiny", block, &other).unwrap();
        assert_eq!(what(wo.resume_at(&carry).unwrap_err()), CarryField::Prefix);
    }
    // The fork's full-pool blocks would need every earlier pooled row: refused by name.
    let w = v4();
    let x = inputs(&w, 512, 22);
    let (_, fork_carry) = decoder_side(&w, FORK, 128, &x, 256);
    let tokens: Vec<u32> = (0..512u32).map(|t| t * 7 + 1).collect();
    let wf = BlockWriter::with_format(FORK, temp_dir("resume-fork"), "tiny", 128, &tokens).unwrap();
    let e = wf.resume_at(&fork_carry).unwrap_err();
    assert!(e.to_string().contains("full-pool"), "{e}");
    assert_eq!(what(e), CarryField::Format);
}

/// Over loopback TCP, as the bridge runs it: the prefill host serves a capture resumed at `S`,
/// the decode host's `ingest` into a writer resumed from the same carry state writes blocks
/// `S / block ..` identical to writing the whole prompt directly.
#[test]
fn resumed_capture_ingests_over_tcp() {
    resumed_capture_over_tcp(1);
}

/// The same over three lanes: resumed at block 2, lane 2 carries the first segment.
#[test]
fn resumed_capture_ingests_over_three_lanes() {
    resumed_capture_over_tcp(3);
}

fn resumed_capture_over_tcp(lanes: u8) {
    use pd_bridge_core::ingest::{ingest, IngestControl, Pull};
    use pd_bridge_core::segment_server::SegmentServer;
    use pd_bridge_core::wire::{CaptureSecret, FrameLimits, PromptDigest};
    let w = v4();
    let (block, s, prompt) = (128, 256, 700);
    let hidden = w.plan.hidden_size();
    let x = inputs(&w, prompt, 23);
    let tokens: Vec<u32> = (0..prompt as u32).map(|t| t * 7 + 1).collect();
    let direct = temp_dir("resume-tcp-direct");
    let wd = BlockWriter::with_format(UP, &direct, "tiny", block, &tokens).unwrap();
    let mut full = CacheBuilder::new(w.clone(), DecoderSteps::for_format(UP, block).unwrap());
    let mut paths = Vec::new();
    for k in 0..prompt / block {
        for (l, rows) in x.iter().enumerate() {
            full.feed(l, k * block, &rows[k * block * hidden..(k + 1) * block * hidden]).unwrap();
        }
        paths.push(wd.write(k, full.layers()).unwrap().path);
    }
    wd.flush().unwrap();
    let (held, _) = decoder_side(&w, UP, block, &x, s);
    let carry_bytes = CarryState::from_block_file(&held, &w.plan, &w.fingerprint, UP, block, s).unwrap().encode();

    let secret = CaptureSecret::from_hex(&"5e".repeat(32)).unwrap();
    let server = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), std::time::Duration::from_secs(20)).unwrap();
    let outbox = server.outbox("req", &secret, &w.fingerprint, &PromptDigest::of(&tokens)).unwrap();
    let (wp, xp, bytes) = (w.clone(), x.clone(), carry_bytes.clone());
    let producer = std::thread::spawn(move || {
        let mut cap = Capture::with_format(UP, wp.clone(), "req", prompt, block).unwrap();
        cap.resume_at(&CarryState::decode(&bytes).unwrap()).unwrap();
        // vLLM's own prefix cache ended at token 200: it recomputes from there.
        let mut start = 200;
        while start < prompt {
            let end = (start + 90).min(prompt);
            for (l, rows) in xp.iter().enumerate() {
                cap.feed(l, start, &rows[start * hidden..end * hidden]).unwrap();
            }
            for seg in cap.take_ready() {
                outbox.push(seg);
            }
            start = end;
        }
        outbox.seal(cap.seal(None));
    });
    let dir = temp_dir("resume-tcp");
    let writer = BlockWriter::with_format(UP, &dir, "tiny", block, &tokens).unwrap().with_plan(&w.plan).unwrap();
    writer.resume_at(&CarryState::decode(&carry_bytes).unwrap()).unwrap();
    let pull = Pull {
        addrs: vec![server.local_addr()],
        token: b"tok",
        secret: &secret,
        request_id: "req",
        fingerprint: &w.fingerprint,
        prompt: PromptDigest::of(&tokens),
        limits: FrameLimits::for_plan(&w.plan, UP, block),
        timeout: std::time::Duration::from_secs(20),
        lanes,
        stages: 1,
    };
    let mut got = Vec::new();
    let done = ingest(&pull, &writer, &IngestControl::default(), |b| got.push(b.index));
    producer.join().unwrap();
    assert_eq!(done.outcome.unwrap(), Seal::Complete { blocks: 5, tokens: 640 });
    assert_eq!(got, vec![2, 3, 4]);
    for i in got {
        let hex = writer.hash(i).unwrap().hex();
        common::assert_same_block(&dir.join(&hex[..1]).join(format!("{hex}.safetensors")), &paths[i]);
    }
}
