//! Benchmark: write DeepSeek-V4-Flash-shaped cache state (43 layers at the real dims, random
//! values) for a long prompt as oMLX blocks, the way the bridge writes them.
//!
//!     cargo run --release -p pd-bridge-core --example bench_block_writer -- TOKENS BLOCK_SIZE OUT_DIR [FORMAT]
//!
//! FORMAT: `fork-0.7.0` (default: every block carries the full pools and the raw rotating
//! buffer) or `upstream-0.6.3` (per-block pool deltas with the previous ratio-4 window, 128-row
//! windows; use BLOCK_SIZE 2048 as upstream does for DeepSeek-V4).
//!
//! Prints one JSON line. Timed: `BlockWriter::write_views` for every block (building the
//! tensors and metadata, writing the temp file; its fsync and rename overlap the next block on
//! the writer's helper thread) plus the final flush. Not timed: generating the random state and
//! deleting each block once the next one is written, so the disk holds at most two blocks (oMLX
//! v3 blocks carry the full pools, so a 64K prompt totals tens of GB).

use std::time::Instant;

use half::bf16;
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::format::PoolLayout;
use pd_bridge_core::view::{ArrayView, LayerView, V4BlockView};
use pd_bridge_core::OmlxFormat;

const LAYERS: usize = 43;
const HEAD: usize = 512;
const INDEX_HEAD: usize = 128;
const WINDOW: usize = 128;

fn ratio(layer: usize) -> usize {
    match layer {
        0 | 1 => 0,
        l if l % 2 == 0 => 4,
        _ => 128,
    }
}

struct Rng(u64);
impl Rng {
    fn fill(&mut self, out: &mut Vec<bf16>, n: usize) {
        for _ in 0..n {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            out.push(bf16::from_bits(((self.0 >> 48) as u16 & 0x3fff) | 0x3c00));
        }
    }
}

fn peak_rss_mb() -> f64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_maxrss as f64 / 1024.0
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let tokens: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(65536);
    let block: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(512);
    let out = std::path::PathBuf::from(args.get(3).cloned().unwrap_or_else(|| "/tmp/pd-bench-rust".into()));
    let format = OmlxFormat::from_name(args.get(4).map(String::as_str).unwrap_or("fork-0.7.0")).expect("format");
    let delta = format.pool_layout() == PoolLayout::Delta;
    let _ = std::fs::remove_dir_all(&out);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    // A raw rotating buffer is at most WINDOW - 1 + block rows; one random buffer serves all.
    let mut window = Vec::new();
    rng.fill(&mut window, (WINDOW - 1 + block) * HEAD);
    // Per layer: [compressor pooled, indexer pooled] grown block by block.
    // Reserved up front so the peak RSS is the state plus the writer, not Vec growth.
    let mut pools: Vec<Vec<Vec<bf16>>> = (0..LAYERS)
        .map(|l| match ratio(l) {
            0 => vec![],
            4 => vec![Vec::with_capacity(tokens / 4 * HEAD), Vec::with_capacity(tokens / 4 * INDEX_HEAD)],
            r => vec![Vec::with_capacity(tokens / r * HEAD)],
        })
        .collect();
    let model = if delta { "DeepSeek-V4-Flash" } else { "/bench/DeepSeek-V4-Flash" };
    // The previous ratio-4 window upstream carries: [4, 2 * width] raw kv and gate.
    let mut prev = Vec::new();
    rng.fill(&mut prev, 4 * 2 * HEAD);
    let ids: Vec<u32> = (0..tokens as u32).map(|i| (i * 7) % 1000).collect();
    let writer = BlockWriter::with_format(format, &out, model, block, &ids).expect("writer");
    let mut previous: Option<std::path::PathBuf> = None;
    let (mut bytes, mut seconds, mut blocks) = (0u64, 0f64, 0usize);
    let rss_before = peak_rss_mb();
    for k in 0..tokens / block {
        let end = (k + 1) * block;
        for (l, p) in pools.iter_mut().enumerate() {
            for (j, pool) in p.iter_mut().enumerate() {
                let width = if j == 0 { HEAD } else { INDEX_HEAD };
                rng.fill(pool, block / ratio(l) * width);
            }
        }
        let empty: &[bf16] = &[];
        let t0 = Instant::now();
        let views: Vec<LayerView<'_>> = (0..LAYERS)
            .map(|l| {
                let r = ratio(l);
                let rows = if r == 0 || delta { end.min(WINDOW) } else { end.min(WINDOW - 1 + block) };
                LayerView::V4(V4BlockView {
                    offset: end,
                    sliding_window: WINDOW,
                    ratio: r,
                    window: ArrayView::new(HEAD, &window[window.len() - rows * HEAD..]),
                    pools: pools[l]
                        .iter()
                        .enumerate()
                        .map(|(j, pooled)| {
                            let w = if j == 0 { HEAD } else { INDEX_HEAD };
                            let od = if r == 4 { 2 * w } else { w };
                            // Upstream's blocks take only this block's rows (the writer slices them).
                            [ArrayView::new(od, empty), ArrayView::new(od, empty), ArrayView::new(w, pooled)]
                        })
                        .collect(),
                    pool_first: vec![0; pools[l].len()],
                    prev: (0..pools[l].len())
                        .map(|j| {
                            let od = 2 * if j == 0 { HEAD } else { INDEX_HEAD };
                            (delta && r == 4).then(|| [ArrayView::new(od, &prev[..4 * od]), ArrayView::new(od, &prev[..4 * od])])
                        })
                        .collect(),
                })
            })
            .collect();
        let w = writer.write_views(k, &views).expect("write");
        seconds += t0.elapsed().as_secs_f64();
        bytes += w.bytes;
        blocks += 1;
        // The previous block is on disk once this one is written (one block in flight).
        if let Some(p) = previous.replace(w.path) {
            std::fs::remove_file(p).expect("remove");
        }
    }
    let t0 = Instant::now();
    writer.flush().expect("flush");
    seconds += t0.elapsed().as_secs_f64();
    let state_mb = pools.iter().flatten().map(|p| p.len() * 2).sum::<usize>() as f64 / 1e6 + window.len() as f64 * 2.0 / 1e6;
    println!(
        "{{\"writer\":\"rust\",\"format\":\"{format}\",\"tokens\":{tokens},\"block_size\":{block},\"blocks\":{blocks},\"bytes\":{bytes},\"seconds\":{seconds:.3},\"gb_per_s\":{:.3},\"tokens_per_s\":{:.0},\"peak_rss_mb\":{:.1},\"rss_before_writing_mb\":{rss_before:.1},\"state_mb\":{state_mb:.1}}}",
        bytes as f64 / seconds / 1e9,
        (blocks * block) as f64 / seconds,
        peak_rss_mb()
    );
    let _ = std::fs::remove_dir_all(&out);
}
