//! MLA's math (DeepSeek-V3 style): per token the normalised latent and the rotated shared key,
//! as mlx-lm's `DeepseekV3Attention` stores them in its `KVCache` (keys = latent, values = k_pe).

use half::bf16;

use crate::numerics::{linear, rms_norm_rows, round_bf16, Rope};
use crate::plan::MlaPlan;
use crate::view::{ArrayView, StateArray};
use crate::weights::MlaLayerWeights;

#[derive(Clone, Debug)]
pub struct MlaLayerState {
    hidden: usize,
    rank: usize,
    rope_dim: usize,
    eps: f32,
    rope: Rope,
    /// YaRN magnitude applied to the rope features before rotation (1 means none).
    mscale: Option<bf16>,
    processed: usize,
    /// Rows before this token were handed out and dropped ([`MlaLayerState::drop_before`]).
    base: usize,
    latent: Vec<bf16>,
    k_pe: Vec<bf16>,
    scratch: Vec<bf16>,
}

impl MlaLayerState {
    pub fn new(plan: &MlaPlan) -> Self {
        let (rope, mscale) = match &plan.yarn {
            Some(y) => {
                let m = y.magnitude();
                (Rope::mla_yarn(plan.rope_head_dim, plan.rope_theta, y), (m != 1.0).then(|| round_bf16(m as f32)))
            }
            None => (Rope::plain(plan.rope_head_dim, plan.rope_theta), None),
        };
        MlaLayerState {
            hidden: plan.hidden_size,
            rank: plan.kv_lora_rank,
            rope_dim: plan.rope_head_dim,
            eps: plan.latent_norm_eps,
            rope,
            mscale,
            processed: 0,
            base: 0,
            latent: Vec::new(),
            k_pe: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// The state after `position` tokens of a resumed request: nothing crosses a block boundary
    /// (each token's latent depends on that token alone), so it holds no rows yet.
    pub(super) fn resume(plan: &MlaPlan, position: usize) -> Self {
        let mut s = Self::new(plan);
        s.processed = position;
        s.base = position;
        s
    }

    pub fn processed(&self) -> usize {
        self.processed
    }

    pub(super) fn feed(&mut self, w: &MlaLayerWeights, start: usize, n: usize, x: &[bf16]) {
        let width = self.rank + self.rope_dim;
        linear(x, n, self.hidden, &w.kv_a.w, &w.kv_a.acc, width, &mut self.scratch);
        let mut latent = Vec::with_capacity(n * self.rank);
        let mut k_pe = Vec::with_capacity(n * self.rope_dim);
        for row in self.scratch.chunks_exact(width) {
            latent.extend_from_slice(&row[..self.rank]);
            k_pe.extend_from_slice(&row[self.rank..]);
        }
        rms_norm_rows(&mut latent, self.rank, &w.kv_a_norm, self.eps);
        if let Some(m) = self.mscale {
            for v in k_pe.iter_mut() {
                *v = round_bf16(v.to_f32() * m.to_f32());
            }
        }
        self.rope.apply(&mut k_pe, self.rope_dim, start);
        self.latent.extend_from_slice(&latent);
        self.k_pe.extend_from_slice(&k_pe);
        self.processed = start + n;
    }

    /// Latent and rotated-key rows of tokens `[start, end)` (clamped to what is held).
    pub fn rows(&self, start: usize, end: usize) -> (ArrayView<'_>, ArrayView<'_>) {
        let end = end.min(self.processed) - self.base.min(end.min(self.processed));
        let start = start.saturating_sub(self.base).min(end);
        (
            ArrayView::new(self.rank, &self.latent[start * self.rank..end * self.rank]),
            ArrayView::new(self.rope_dim, &self.k_pe[start * self.rope_dim..end * self.rope_dim]),
        )
    }

    /// Drop the rows of tokens before `token`: each token's latent depends on that token alone,
    /// so a streaming capture keeps only what it has not shipped yet.
    pub fn drop_before(&mut self, token: usize) {
        let token = token.min(self.processed);
        if token > self.base {
            let n = token - self.base;
            self.latent.drain(..n * self.rank);
            self.k_pe.drain(..n * self.rope_dim);
            self.base = token;
        }
    }

    pub fn snapshot(&self) -> Vec<StateArray> {
        vec![
            StateArray { name: "latent", shape: vec![self.processed - self.base, self.rank], data: self.latent.clone() },
            StateArray { name: "k_pe", shape: vec![self.processed - self.base, self.rope_dim], data: self.k_pe.clone() },
        ]
    }
}
