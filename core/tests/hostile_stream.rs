//! A prefill host that holds the token (compromised, or buggy) streams well-framed nonsense over
//! the real encrypted wire: a segment of NaN, one off the block grid, one whose arrays have the
//! wrong width. The decode host refuses that segment before writing it, naming block, layer and
//! array; the whole validated blocks before it stay on disk and validate against the plan;
//! nothing of the bad block is written. A clean request pulled at the same time from the same
//! server gets every block, identical to a direct write: a bad stream disturbs only itself.

mod common;

use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use pd_bridge_core::block::validate::{inspect_with, Expect};
use pd_bridge_core::block::{block_path, BlockWriter};
use pd_bridge_core::capture::Capture;
use pd_bridge_core::segment::Segment;
use pd_bridge_core::ingest::{IngestControl, Ingested};
use pd_bridge_core::segment_server::SegmentServer;
use pd_bridge_core::wire::{CaptureSecret, PromptDigest, Seal};
use pd_bridge_core::{CoreError, DecoderWeights, OmlxFormat};

use common::{files_under, random_rows, temp_dir, v4_model_dir, Rng};

const BLOCK: usize = 128;
const BLOCKS: usize = 4;

fn secret(id: &str) -> CaptureSecret {
    let byte = if id == "clean" { "c1" } else { "5e" };
    CaptureSecret::from_hex(&byte.repeat(32)).unwrap()
}

/// A capture's segments for a prompt of `BLOCKS` blocks.
fn segments(w: &Arc<DecoderWeights>, format: OmlxFormat, id: &str, seed: u64) -> (Vec<u32>, Vec<Segment>, Seal) {
    let prompt = BLOCKS * BLOCK + 9;
    let hidden = w.plan.hidden_size();
    let mut rng = Rng::new(seed);
    let mut cap = Capture::with_format(format, w.clone(), id, prompt, BLOCK).unwrap();
    let mut out = Vec::new();
    for l in 0..w.plan.num_layers() {
        cap.feed(l, 0, &random_rows(&mut rng, prompt, hidden)).unwrap();
    }
    out.extend(cap.take_ready());
    let seal = cap.seal(None);
    ((0..prompt as u32).map(|t| t + seed as u32).collect(), out, seal)
}

fn serve(server: &SegmentServer, w: &DecoderWeights, id: &str, tokens: &[u32], segs: Vec<Segment>, seal: Seal) -> std::thread::JoinHandle<()> {
    let outbox = server.outbox(id, &secret(id), &w.fingerprint, &PromptDigest::of(tokens)).unwrap();
    std::thread::spawn(move || {
        for s in segs {
            outbox.push(s);
            std::thread::sleep(Duration::from_millis(5));
        }
        outbox.seal(seal);
    })
}

fn pull(server: &SegmentServer, w: &DecoderWeights, id: &str, tokens: &[u32], writer: &BlockWriter) -> Ingested {
    common::pull(server, w, id, &secret(id), tokens, writer, BLOCK, Duration::from_secs(20), &IngestControl::default(), |_| {})
}

type Poison = fn(&mut Segment);

fn nan(s: &mut Segment) {
    s.arrays[0][3] = bf16::NAN;
}

fn off_grid(s: &mut Segment) {
    s.header.start += 64;
    s.header.end += 64;
}

/// Layer 1's window declared half as wide (twice the rows): the same bytes, the wrong width.
fn wide(s: &mut Segment) {
    let at: usize = s.header.layers[..1].iter().map(|l| l.arrays.len()).sum();
    let a = &mut s.header.layers[1].arrays[0];
    (a.rows, a.width) = (a.rows * 2, a.width / 2);
    assert!(s.arrays[at].len() == (a.rows * a.width) as usize);
}

#[test]
fn a_poisoned_stream_fails_alone_and_keeps_its_valid_prefix() {
    let w = Arc::new(DecoderWeights::load(v4_model_dir(71)).unwrap());
    // Off the grid, the wire's reader already refuses the positions (a typed wire error).
    let cases: [(&str, Poison, Option<usize>, &str); 3] = [("NaN", nan, Some(0), "is NaN"), ("off the grid", off_grid, None, "out of order"), ("wrong width", wide, Some(1), "expected")];
    for format in OmlxFormat::ALL {
        for (what, poison, layer, why) in cases {
            let server = SegmentServer::bind("127.0.0.1:0", b"tok".to_vec(), Duration::from_secs(20)).unwrap();
            let (tokens, mut bad, bad_seal) = segments(&w, format, "poisoned", 1);
            poison(&mut bad[2]);
            let (clean_tokens, clean, clean_seal) = segments(&w, format, "clean", 2);
            let producers = [serve(&server, &w, "poisoned", &tokens, bad, bad_seal), serve(&server, &w, "clean", &clean_tokens, clean.clone(), clean_seal.clone())];
            let (dir_bad, dir_clean) = (temp_dir("poisoned"), temp_dir("clean"));
            let wb = BlockWriter::with_format(format, &dir_bad, "m", BLOCK, &tokens).unwrap().with_plan(&w.plan).unwrap();
            let wc = BlockWriter::with_format(format, &dir_clean, "m", BLOCK, &clean_tokens).unwrap().with_plan(&w.plan).unwrap();
            let (got_bad, got_clean) = std::thread::scope(|sc| {
                let c = sc.spawn(|| pull(&server, &w, "clean", &clean_tokens, &wc));
                let b = pull(&server, &w, "poisoned", &tokens, &wb);
                (b, c.join().unwrap())
            });
            for p in producers {
                p.join().unwrap();
            }
            let ctx = format!("{format} {what}");
            match got_bad.outcome {
                Err(CoreError::Segment { block, layer: l, reason, .. }) => {
                    assert_eq!((block, l), (2, layer), "{ctx}: {reason}");
                    assert!(reason.contains(why), "{ctx}: {reason}");
                }
                Err(CoreError::Wire(reason)) if layer.is_none() => assert!(reason.contains(why) && reason.contains("segment 2"), "{ctx}: {reason}"),
                other => panic!("{ctx}: {other:?}"),
            }
            assert_eq!(got_bad.blocks, 2, "{ctx}");
            wb.flush().unwrap();
            let expect = Expect { format, model_name: Some("m".into()), num_layers: Some(w.plan.num_layers()), block_size: Some(BLOCK) };
            let files = files_under(&dir_bad);
            assert_eq!(files.len(), 2, "{ctx}: {files:?}");
            for k in 0..2 {
                inspect_with(&block_path(&dir_bad, wb.hash(k).unwrap()), &expect, Some(&w.plan), None).unwrap();
            }
            assert!(!block_path(&dir_bad, wb.hash(2).unwrap()).exists(), "{ctx}");

            // The clean request on the same server at the same time: complete, identical to a
            // direct write of its segments.
            assert_eq!(got_clean.outcome.unwrap(), clean_seal, "{ctx}");
            assert_eq!(got_clean.blocks, BLOCKS, "{ctx}");
            let direct = temp_dir("direct");
            let wd = BlockWriter::with_format(format, &direct, "m", BLOCK, &clean_tokens).unwrap().with_plan(&w.plan).unwrap();
            for seg in &clean {
                wd.write_segment(seg).unwrap();
            }
            wd.flush().unwrap();
            for k in 0..BLOCKS {
                common::assert_same_block(&block_path(&direct, wd.hash(k).unwrap()), &block_path(&dir_clean, wc.hash(k).unwrap()));
            }
        }
    }
}
