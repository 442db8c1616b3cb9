//! What one frame may declare before a byte of it is read: the largest segment one block of the
//! decoder's plan can produce, and a small bound for everything else.

use crate::format::{OmlxFormat, Overlap};
use crate::plan::{ModelPlan, V4LayerKind};

/// Seals, errors and the pull request are short JSON or text.
pub const MAX_CONTROL_PAYLOAD: u64 = 64 << 10;

/// The cap a reader uses when it knows no plan (in-memory streams of tests and tools).
pub const UNPLANNED_SEGMENT_PAYLOAD: u64 = 256 << 20;

/// Header JSON per layer and per array, generously: a layer header is under 200 bytes, an
/// array shape under 40; the request id and fingerprint are under 300 together.
const HEADER_BASE: u64 = 4096;
const HEADER_PER_LAYER: u64 = 512;
const HEADER_PER_ARRAY: u64 = 64;

/// The largest payload a frame of each kind may declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    pub segment: u64,
    pub control: u64,
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits { segment: UNPLANNED_SEGMENT_PAYLOAD, control: MAX_CONTROL_PAYLOAD }
    }
}

impl FrameLimits {
    /// Limits for a stream of `plan`'s segments in `format` with `block_size`-token blocks.
    pub fn for_plan(plan: &ModelPlan, format: OmlxFormat, block_size: usize) -> Self {
        FrameLimits { segment: max_segment_payload(plan, format, block_size), control: MAX_CONTROL_PAYLOAD }
    }
}

/// An upper bound on the encoded size of one block's segment (`Segment::encode`): per layer the
/// arrays the capture ships at a block boundary, each bounded by the plan's widths and the block.
///
/// DeepSeek-V4: the window (at most `sliding_window + block_size` rows: a raw rotating buffer
/// holds up to `max_size + L - 1`), and per pool (two on ratio-4 layers, one on other compressed
/// layers) the kv/gate remainders (under `2 * ratio` rows of at most twice the widest head: the
/// ratio-4 overlap doubles the width), the same again for the carried overlap, and the pooled rows
/// new in this block (`block_size / ratio`, plus one either side). MLA: the block's latent and
/// rope rows. Deliberately loose (a constant factor), never below what a real block needs: the
/// point is that nobody can make the reader hold more than a block's worth.
pub fn max_segment_payload(plan: &ModelPlan, format: OmlxFormat, block_size: usize) -> u64 {
    let bs = block_size as u64;
    let (elements, arrays): (u64, u64) = match plan {
        ModelPlan::DeepseekV4(p) => {
            let head = p.head_dim as u64;
            let widest = p.head_dim.max(p.index_head_dim) as u64;
            let per_pool_arrays = if format.overlap() == Overlap::Carried { 5 } else { 3 };
            let mut elements = 0u64;
            let mut arrays = 0u64;
            for layer in 0..p.num_layers {
                elements += (p.sliding_window as u64 + bs) * head;
                arrays += 1;
                let ratio = p.compress_ratios[layer] as u64;
                let pools = match p.layer_kind(layer) {
                    V4LayerKind::Window => 0,
                    V4LayerKind::Sparse => 2,
                    V4LayerKind::Compressed => 1,
                };
                let remainder = 2 * ratio * 2 * widest;
                let pooled = (bs / ratio.max(1) + 2) * widest;
                elements += pools * (4 * remainder + pooled);
                arrays += pools * per_pool_arrays;
            }
            (elements, arrays)
        }
        ModelPlan::Mla(p) => (p.num_layers as u64 * bs * (p.kv_lora_rank + p.rope_head_dim) as u64, 2 * p.num_layers as u64),
    };
    let layers = plan.num_layers() as u64;
    4 + HEADER_BASE + HEADER_PER_LAYER * layers + HEADER_PER_ARRAY * arrays + 2 * elements
}
