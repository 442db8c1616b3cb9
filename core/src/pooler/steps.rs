//! The decoder's prefill grid: where it starts each forward call (oMLX prefills block by block)
//! and the semantics that depend on it (the ratio-4 overlap, the window rows a block keeps, how
//! pooling sums round), per oMLX format. Every layer's math reads it; it reads only the format.

use crate::error::{CoreError, Result};
use crate::format::{OmlxFormat, Overlap, PoolSum, WindowRows};

/// Where the decoder starts each prefill forward call: at every multiple of `step` tokens
/// (oMLX prefills block by block, so this is its cache block size), and whether its ratio-4
/// overlap restarts at each call or carries across.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecoderSteps {
    pub step: usize,
    pub overlap: Overlap,
    /// What a block keeps of a compressed layer's window (decides how many rows to retain).
    pub window_rows: WindowRows,
    /// How the decoder's MLX sums a pooling window's products.
    pub pool_sum: PoolSum,
}

impl DecoderSteps {
    /// The fork's semantics (the overlap restarts at every call, blocks keep the raw window).
    pub fn new(step: usize) -> Result<Self> {
        Self::for_format(OmlxFormat::Fork070, step)
    }

    /// The grid and overlap semantics of `format`'s decoder with blocks of `step` tokens.
    pub fn for_format(format: OmlxFormat, step: usize) -> Result<Self> {
        if step == 0 {
            return Err(CoreError::config("decoder_step", "must be positive"));
        }
        Ok(DecoderSteps { step, overlap: format.overlap(), window_rows: format.window_rows(), pool_sum: format.pool_sum() })
    }

    /// Whether a ratio-4 window ending at `base` is the previous window of the one starting there.
    pub fn carries(&self, base: usize, ratio: usize) -> bool {
        base > 0 && (self.overlap == Overlap::Carried || self.call_of(base - 1) == self.call_of(base + ratio - 1))
    }

    /// Index of the decoder forward call that processes token `t`.
    pub fn call_of(&self, t: usize) -> usize {
        t / self.step
    }
}
