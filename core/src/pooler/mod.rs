//! The pooler: per-layer decoder cache state, fed one chunk of attention input at a time. The
//! math of each layer is its model family's ([`crate::family`]); the pooler holds one
//! [`LayerState`] per layer, checks that chunks arrive whole and in order, and resumes a request
//! from its carry state ([`carry`]).
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
//! (0.5.2rc1 on, #2271) carries the previous window across calls
//! ([`crate::format::Overlap::Carried`]): there the grid changes nothing.

pub mod carry;
pub(crate) mod chunk;
pub mod steps;

use std::sync::Arc;

use half::bf16;

use crate::error::{CoreError, Result};
use crate::family::{self, LayerMath};
use crate::segment::BlockPlan;
use crate::view::{LayerView, StateArray};
use crate::weights::DecoderWeights;

use carry::CarryState;
pub use steps::DecoderSteps;

/// A layer's cache state, whichever model family computes it ([`crate::family`]).
#[derive(Debug)]
pub struct LayerState(Box<dyn LayerMath>);

impl Clone for LayerState {
    fn clone(&self) -> Self {
        LayerState(self.0.boxed_clone())
    }
}

impl LayerState {
    /// Tokens folded into the state.
    pub fn processed(&self) -> usize {
        self.0.processed()
    }

    /// The state as named arrays: what the decoder's cache objects hold for this layer.
    pub fn snapshot(&self) -> Vec<StateArray> {
        self.0.snapshot()
    }

    /// The state as the block `[start, end)` stores it (the state has processed `end` tokens).
    pub fn view(&self, start: usize, end: usize) -> LayerView<'_> {
        self.0.view(start, end)
    }

    /// The streaming capture: copy this layer's part of `block`'s segment (layer `layer` of its
    /// plan) into `body` once the state reached the block's end, and drop what it no longer needs.
    pub fn take_part(&mut self, block: &BlockPlan, layer: usize, body: &mut [bf16]) -> Result<()> {
        self.0.take_part(block, layer, body)
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
        let family = family::of(&weights.plan);
        let layers = (0..weights.layers.len()).map(|i| LayerState(family.new_layer(&weights.plan, i, steps))).collect();
        CacheBuilder { weights, layers, origin: 0 }
    }

    /// The state after `carry.position` tokens, rebuilt from the decoder's carry state at that
    /// block boundary: the grid and overlap semantics are the carry state's format and block
    /// size. Refused (naming what) unless the carry state was made from these weights and fits
    /// their plan.
    pub fn resume(weights: Arc<DecoderWeights>, carry: &CarryState) -> Result<Self> {
        carry.check_for(&weights.fingerprint, &family::geometry(&weights.plan, carry.format, carry.block_size))?;
        let steps = DecoderSteps::for_format(carry.format, carry.block_size)?;
        let s = carry.position;
        let family = family::of(&weights.plan);
        let layers = carry
            .layers
            .iter()
            .enumerate()
            .map(|(i, c)| family.resume_layer(&weights.plan, i, steps, c, s).map(LayerState))
            .collect::<Result<Vec<_>>>()?;
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
        let Some((start, x)) = chunk::admit(layer, hidden, origin, state.processed(), start, x)? else {
            return Ok(());
        };
        let rows = x.len() / hidden;
        state.0.feed(&self.weights.layers[layer], start, rows, x)
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
