//! The pooler: per-layer decoder cache state, fed one chunk of attention input at a time.
//!
//! After any sequence of chunks covering tokens `[0, T)` a layer's state holds exactly what the
//! decoder's MLX caches hold after prefilling the same `T` tokens: for DeepSeek-V4 the rotating
//! window, the compressor pools with their remainder rows, the indexer pool; for MLA the latent
//! and the rotated key. How the input is chunked never changes the result.
//!
//! With the fork (flyto-mlx 0.7.0) the result also depends on where the *decoder* splits its own
//! prefill into forward calls: its DeepSeek-V4 compressor starts the ratio-4 overlap afresh in
//! every forward call (the first window of a call sees a zero previous window). That grid is
//! [`DecoderSteps`], fixed per cache and independent of the input chunking. Upstream oMLX
//! (0.5.2rc1 on, #2271) carries the previous window across calls ([`Overlap::Carried`]): there
//! the grid changes nothing.

pub mod carry;
mod mla;
mod steps;
mod v4;

use std::sync::Arc;

use half::bf16;

use crate::error::{CoreError, Result};
use crate::geometry::Geometry;
use crate::view::{LayerView, StateArray};
use crate::weights::{DecoderWeights, LayerWeights};

use carry::{CarryState, LayerCarry};
pub use mla::MlaLayerState;
pub use steps::DecoderSteps;
pub use v4::V4LayerState;

/// A layer's cache state, whichever model family it belongs to.
#[derive(Clone, Debug)]
pub enum LayerState {
    V4(V4LayerState),
    Mla(MlaLayerState),
}

impl LayerState {
    /// Tokens folded into the state.
    pub fn processed(&self) -> usize {
        match self {
            LayerState::V4(s) => s.processed(),
            LayerState::Mla(s) => s.processed(),
        }
    }

    /// The state as named arrays: what the decoder's cache objects hold for this layer.
    pub fn snapshot(&self) -> Vec<StateArray> {
        match self {
            LayerState::V4(s) => s.snapshot(),
            LayerState::Mla(s) => s.snapshot(),
        }
    }

    /// The state as the block `[start, end)` stores it (the state has processed `end` tokens).
    pub fn view(&self, start: usize, end: usize) -> LayerView<'_> {
        match self {
            LayerState::V4(s) => LayerView::V4(s.block_view()),
            LayerState::Mla(s) => {
                let (latent, k_pe) = s.rows(start, end);
                LayerView::Kv(latent, k_pe)
            }
        }
    }
}

/// The decoder's cache for every layer of one request, built from attention inputs.
pub struct CacheBuilder {
    weights: Arc<DecoderWeights>,
    layers: Vec<LayerState>,
    /// The block boundary the state was resumed at (0: built from the first token). Rows before
    /// it are part of the carry state and are ignored when fed again.
    origin: usize,
}

impl CacheBuilder {
    pub fn new(weights: Arc<DecoderWeights>, steps: DecoderSteps) -> Self {
        let layers = weights
            .layers
            .iter()
            .enumerate()
            .map(|(i, lw)| match (lw, &weights.plan) {
                (LayerWeights::V4(_), crate::plan::ModelPlan::DeepseekV4(p)) => LayerState::V4(V4LayerState::new(p, i, steps)),
                (LayerWeights::Mla(_), crate::plan::ModelPlan::Mla(p)) => LayerState::Mla(MlaLayerState::new(p)),
                _ => unreachable!("weights are loaded per plan family"),
            })
            .collect();
        CacheBuilder { weights, layers, origin: 0 }
    }

    /// The state after `carry.position` tokens, rebuilt from the decoder's carry state at that
    /// block boundary: the grid and overlap semantics are the carry state's format and block
    /// size. Refused (naming what) unless the carry state was made from these weights and fits
    /// their plan.
    pub fn resume(weights: Arc<DecoderWeights>, carry: &CarryState) -> Result<Self> {
        carry.check_for(&weights.fingerprint, &Geometry::of(&weights.plan, carry.format, carry.block_size))?;
        let steps = DecoderSteps::for_format(carry.format, carry.block_size)?;
        let s = carry.position;
        let layers = weights
            .layers
            .iter()
            .zip(&carry.layers)
            .enumerate()
            .map(|(i, (lw, c))| match (lw, &weights.plan, c) {
                (LayerWeights::V4(_), crate::plan::ModelPlan::DeepseekV4(p), LayerCarry::V4(c)) => LayerState::V4(V4LayerState::resume(p, i, steps, c, s)),
                (LayerWeights::Mla(_), crate::plan::ModelPlan::Mla(p), LayerCarry::Kv) => LayerState::Mla(MlaLayerState::resume(p, s)),
                _ => unreachable!("CarryState::check_for matched the layers to the plan"),
            })
            .collect();
        Ok(CacheBuilder { weights, layers, origin: s })
    }

    /// The weights the state is computed with.
    pub fn weights(&self) -> &Arc<DecoderWeights> {
        &self.weights
    }

    /// Where a resumed state starts (0 for one built from the first token).
    pub fn origin(&self) -> usize {
        self.origin
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Tokens of `layer` already folded into its state.
    pub fn processed(&self, layer: usize) -> Option<usize> {
        self.layers.get(layer).map(LayerState::processed)
    }

    /// Fold `rows` tokens of `layer`'s attention input (`[rows, hidden]` bf16, row-major), the
    /// first at absolute position `start`, into that layer's state. Chunks of a layer must be
    /// contiguous: `start` equals the tokens already processed. A resumed state ignores the rows
    /// before its [`Self::origin`] (the prefill engine may recompute from further back).
    pub fn feed(&mut self, layer: usize, start: usize, x: &[bf16]) -> Result<()> {
        let hidden = self.weights.plan.hidden_size();
        let n = self.layers.len();
        let origin = self.origin;
        let state = self.layers.get_mut(layer).ok_or_else(|| CoreError::input(layer, format!("the model has {n} layers")))?;
        if x.is_empty() || x.len() % hidden != 0 {
            return Err(CoreError::input(layer, format!("{} values is not a positive whole number of rows of width {hidden}", x.len())));
        }
        let (start, x) = if start < origin {
            let skip = (origin - start).min(x.len() / hidden);
            if skip * hidden == x.len() {
                return Ok(());
            }
            (origin, &x[skip * hidden..])
        } else {
            (start, x)
        };
        let processed = state.processed();
        if start != processed {
            let why = if processed == origin && origin > 0 {
                format!("chunk starts at token {start} but the state resumed at {origin}: rows [{origin}, {start}) were never fed (a resumed capture needs every row from its resume point on)")
            } else {
                format!("chunk starts at token {start} but {processed} tokens are processed")
            };
            return Err(CoreError::input(layer, why));
        }
        let rows = x.len() / hidden;
        match (state, &self.weights.layers[layer]) {
            (LayerState::V4(s), LayerWeights::V4(w)) => s.feed(w, start, rows, x),
            (LayerState::Mla(s), LayerWeights::Mla(w)) => s.feed(w, start, rows, x),
            _ => unreachable!("states are built per plan family"),
        }
        Ok(())
    }

    pub fn layer(&self, layer: usize) -> Option<&LayerState> {
        self.layers.get(layer)
    }

    pub fn layers(&self) -> &[LayerState] {
        &self.layers
    }

    pub fn layer_mut(&mut self, layer: usize) -> Option<&mut LayerState> {
        self.layers.get_mut(layer)
    }

    pub fn hidden_size(&self) -> usize {
        self.weights.plan.hidden_size()
    }
}
