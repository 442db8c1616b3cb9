//! What one frame may declare before a byte of it is read: the largest segment one block of the
//! decoder's plan can produce, and a small bound for everything else.

use crate::format::OmlxFormat;
use crate::plan::ModelPlan;

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
/// arrays the capture ships at a block boundary, each bounded by the plan's widths and the block
/// (the values and arrays are the model family's answer, [`crate::family::Family::segment_bound`]),
/// plus the header. Deliberately loose (a constant factor), never below what a real block needs:
/// the point is that nobody can make the reader hold more than a block's worth.
pub fn max_segment_payload(plan: &ModelPlan, format: OmlxFormat, block_size: usize) -> u64 {
    let (elements, arrays) = crate::family::of(plan).segment_bound(plan, format, block_size);
    let layers = plan.num_layers() as u64;
    4 + HEADER_BASE + HEADER_PER_LAYER * layers + HEADER_PER_ARRAY * arrays + 2 * elements
}
