//! DeepSeek-V4.1's per-layer cache state, following mlx-lm's `deepseek_v41` operation by
//! operation: what its `LayerCache` holds after the same tokens.
//!
//! * `window`: `kv_norm(kv_proj(x))`, its last `qk_rope_head_dim` features rotated in float32 at
//!   the token's position (the layer's RoPE: `rope_theta` for a window-only layer, the YaRN
//!   `compress_rope_theta` otherwise), fake-quantized to FP8 in 32-value blocks; the last
//!   `sliding_window` rows (bf16).
//! * On a KV source with ratio 1 or 2 (`compress_kv`, float32): per group of `ratio` tokens a
//!   latent — ratio 1: `kv_norm(kv_proj(x))` in float32; ratio 2: the softmax(gate)-weighted sum of
//!   the group's `kv_proj` rows, rounded to bf16, then `kv_norm` in float32 — rotated at position
//!   `group · ratio` and fake-quantized to FP4 (16-value blocks, E4M3 scales). Ratio 2 keeps the
//!   rows of an unfinished group (`pending_kv`, `pending_gate`, float32).
//! * On a pool that is also an index source (`index_k`, float32): `k_norm(k_proj(latent))` of the
//!   same latent, rotated alike and fake-quantized to FP4 (32-value blocks, power-of-two scales).
//!
//! Each array is a function of rows or groups alone (groups counted from token 0), so the state
//! after tokens `[0, T)` does not depend on how they were cut into chunks, nor on the decoder's
//! own forward calls.

use std::sync::Arc;

use half::bf16;

use super::carry::{V41Carry, V41LayerCarry};
use super::numerics::{fake_quant_fp4, fake_quant_fp8_bf16, linear_f32, rms_norm_f32, rope_f32, rope_position};
use super::plan::V41Plan;
use super::weights::{V41LayerWeights, V41PoolWeights, V41Weights};
use crate::error::{CoreError, Result};
use crate::pooler::chunk;
use crate::numerics::{linear, rms_norm_rows, round_bf16, softmax_row};

/// The values of one state array.
#[derive(Clone, Debug, PartialEq)]
pub enum V41Data {
    Bf16(Vec<bf16>),
    F32(Vec<f32>),
}

/// One named array of a layer's state, row-major, in the dtype mlx-lm's cache holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct V41Array {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub data: V41Data,
}

impl V41Array {
    /// `"bfloat16"` or `"float32"`, as MLX names them.
    pub fn dtype(&self) -> &'static str {
        match self.data {
            V41Data::Bf16(_) => "bfloat16",
            V41Data::F32(_) => "float32",
        }
    }

    /// The values as little-endian bytes.
    pub fn le_bytes(&self) -> Vec<u8> {
        match &self.data {
            V41Data::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            V41Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// The rotating window.
#[derive(Clone, Debug)]
struct Window {
    size: usize,
    head_dim: usize,
    eps: f32,
    inv_freqs: Vec<f32>,
    rows: Vec<bf16>,
    scratch: Vec<bf16>,
    tail: Vec<f32>,
}

impl Window {
    fn feed(&mut self, w: &V41LayerWeights, start: usize, n: usize, x: &[bf16], hidden: usize) {
        // Rows that fall out of the window before the chunk ends are never needed; every step is
        // row-independent, so skipping them changes nothing.
        let skip = n.saturating_sub(self.size);
        let hd = self.head_dim;
        linear(&x[skip * hidden..], n - skip, hidden, &w.kv_proj.w, &w.kv_proj.acc, hd, &mut self.scratch);
        rms_norm_rows(&mut self.scratch, hd, &w.kv_norm, self.eps);
        let rd = 2 * self.inv_freqs.len();
        for (i, row) in self.scratch.chunks_exact_mut(hd).enumerate() {
            // `_apply_rope`: the rotated tail in float32, cast back to the row's bf16.
            self.tail.clear();
            self.tail.extend(row[hd - rd..].iter().map(|v| v.to_f32()));
            rope_f32(&mut self.tail, &self.inv_freqs, rope_position(i, start + skip, 1));
            for (d, s) in row[hd - rd..].iter_mut().zip(&self.tail) {
                *d = round_bf16(*s);
            }
            fake_quant_fp8_bf16(row, hd, 32);
        }
        self.rows.extend_from_slice(&self.scratch);
        let have = self.rows.len() / hd;
        if have > self.size {
            self.rows.drain(..(have - self.size) * hd);
        }
    }
}

/// A KV source's compressor, its pools and (on an index source) the index keys.
#[derive(Clone, Debug)]
struct Pools {
    ratio: usize,
    head_dim: usize,
    index_head_dim: usize,
    with_index: bool,
    eps: f32,
    inv_freqs: Vec<f32>,
    pending_kv: Vec<f32>,
    pending_gate: Vec<f32>,
    compress_kv: Vec<f32>,
    index_k: Vec<f32>,
    /// Groups before the first row of `compress_kv` (those before a resume point, which the
    /// decoder already holds).
    base: usize,
    xf: Vec<f32>,
    kv: Vec<f32>,
    gate: Vec<f32>,
}

impl Pools {
    /// Groups pooled so far.
    fn groups(&self) -> usize {
        self.base + self.compress_kv.len() / self.head_dim
    }

    fn feed(&mut self, w: &V41PoolWeights, n: usize, x: &[bf16], hidden: usize) {
        let hd = self.head_dim;
        self.xf.clear();
        self.xf.extend(x.iter().map(|v| v.to_f32()));
        let mut kv = std::mem::take(&mut self.kv);
        linear_f32(&self.xf, n, hidden, &w.kv_proj, hd, &mut kv);
        let first = self.groups();
        let latent = if self.ratio == 1 {
            // `kv_norm(kv_proj(x))`: float32 throughout.
            rms_norm_f32(&mut kv, hd, &w.kv_norm, self.eps);
            std::mem::take(&mut kv)
        } else {
            let mut gate = std::mem::take(&mut self.gate);
            linear_f32(&self.xf, n, hidden, w.gate_proj.as_ref().expect("ratio 2 has a gate"), hd, &mut gate);
            self.pending_kv.extend_from_slice(&kv);
            self.pending_gate.extend_from_slice(&gate);
            self.gate = gate;
            let r = self.ratio;
            let groups = self.pending_kv.len() / hd / r;
            let mut latent = vec![0f32; groups * hd];
            let (mut vals, mut wts) = (vec![0f32; r], vec![0f32; r]);
            for g in 0..groups {
                let (pk, pg) = (&self.pending_kv[g * r * hd..], &self.pending_gate[g * r * hd..]);
                for c in 0..hd {
                    for k in 0..r {
                        vals[k] = pg[k * hd + c];
                    }
                    // `mx.softmax(gate, axis=2)` (not the last axis: MLX's composite softmax),
                    // then `mx.sum(kv * weights, axis=2)` from a zero accumulator.
                    softmax_row(&vals, &mut wts);
                    let mut acc = 0f32;
                    for k in 0..r {
                        acc += pk[k * hd + c] * wts[k];
                    }
                    // `latent.astype(x.dtype)`: the pooled latent is rounded to bf16 before
                    // the float32 norm.
                    latent[g * hd + c] = round_bf16(acc).to_f32();
                }
            }
            self.pending_kv.drain(..groups * r * hd);
            self.pending_gate.drain(..groups * r * hd);
            rms_norm_f32(&mut latent, hd, &w.kv_norm, self.eps);
            latent
        };
        self.kv = kv;
        let groups = latent.len() / hd;
        if groups == 0 {
            return;
        }
        let rd = 2 * self.inv_freqs.len();
        let mut ckv = latent.clone();
        for (g, row) in ckv.chunks_exact_mut(hd).enumerate() {
            rope_f32(&mut row[hd - rd..], &self.inv_freqs, rope_position(g, first, self.ratio));
        }
        fake_quant_fp4(&mut ckv, hd, 16, true);
        self.compress_kv.extend_from_slice(&ckv);
        if let (true, Some((k_proj, k_norm))) = (self.with_index, w.index.as_ref()) {
            let ih = self.index_head_dim;
            let mut k = Vec::new();
            linear_f32(&latent, groups, hd, k_proj, ih, &mut k);
            rms_norm_f32(&mut k, ih, k_norm, self.eps);
            for (g, row) in k.chunks_exact_mut(ih).enumerate() {
                rope_f32(&mut row[ih - rd..], &self.inv_freqs, rope_position(g, first, self.ratio));
            }
            fake_quant_fp4(&mut k, ih, 32, false);
            self.index_k.extend_from_slice(&k);
        }
    }
}

/// One DeepSeek-V4.1 layer's cache state.
#[derive(Clone, Debug)]
pub struct V41LayerState {
    hidden: usize,
    processed: usize,
    window: Window,
    pools: Option<Pools>,
}

impl V41LayerState {
    pub fn new(plan: &V41Plan, layer: usize) -> Self {
        let kind = plan.layer_kind(layer);
        let inv_freqs = plan.rope(layer).inv_freqs().to_vec();
        V41LayerState {
            hidden: plan.hidden_size,
            processed: 0,
            window: Window {
                size: plan.sliding_window,
                head_dim: plan.head_dim,
                eps: plan.rms_norm_eps,
                inv_freqs: inv_freqs.clone(),
                rows: Vec::new(),
                scratch: Vec::new(),
                tail: Vec::new(),
            },
            pools: kind.pools.then(|| Pools {
                ratio: kind.ratio,
                head_dim: plan.head_dim,
                index_head_dim: plan.index_head_dim,
                with_index: kind.index_keys,
                eps: plan.rms_norm_eps,
                inv_freqs,
                pending_kv: Vec::new(),
                pending_gate: Vec::new(),
                compress_kv: Vec::new(),
                index_k: Vec::new(),
                base: 0,
                xf: Vec::new(),
                kv: Vec::new(),
                gate: Vec::new(),
            }),
        }
    }

    pub fn processed(&self) -> usize {
        self.processed
    }

    /// The compress ratio of the layer's pool (None: the layer keeps only its window).
    pub fn pool_ratio(&self) -> Option<usize> {
        self.pools.as_ref().map(|p| p.ratio)
    }

    fn feed(&mut self, w: &V41LayerWeights, start: usize, n: usize, x: &[bf16]) {
        self.window.feed(w, start, n, x, self.hidden);
        if let (Some(p), Some(pw)) = (self.pools.as_mut(), w.pools.as_ref()) {
            p.feed(pw, n, x, self.hidden);
        }
        self.processed = start + n;
    }

    /// What mlx-lm's `LayerCache` holds, under its field names: `window` (bf16), and on a pool
    /// `compress_kv`, `index_k` (an index source) and `pending_kv`/`pending_gate` (ratio 2), all
    /// float32. After a resume `compress_kv` and `index_k` start at the resume point's group.
    pub fn snapshot(&self) -> Vec<V41Array> {
        let hd = self.window.head_dim;
        let mut out = vec![V41Array { name: "window", shape: vec![self.window.rows.len() / hd, hd], data: V41Data::Bf16(self.window.rows.clone()) }];
        if let Some(p) = &self.pools {
            let f = |name, width: usize, v: &Vec<f32>| V41Array { name, shape: vec![v.len() / width, width], data: V41Data::F32(v.clone()) };
            out.push(f("compress_kv", hd, &p.compress_kv));
            if p.with_index {
                out.push(f("index_k", p.index_head_dim, &p.index_k));
            }
            if p.ratio > 1 {
                out.push(f("pending_kv", hd, &p.pending_kv));
                out.push(f("pending_gate", hd, &p.pending_gate));
            }
        }
        out
    }

    fn carry(&self) -> V41LayerCarry {
        let pending = self.pools.as_ref().filter(|p| p.ratio > 1);
        V41LayerCarry {
            window: self.window.rows.clone(),
            pending_kv: pending.map_or_else(Vec::new, |p| p.pending_kv.clone()),
            pending_gate: pending.map_or_else(Vec::new, |p| p.pending_gate.clone()),
        }
    }

    /// The state after `position` tokens from its carry (checked against the plan already).
    fn resume(plan: &V41Plan, layer: usize, carry: &V41LayerCarry, position: usize) -> Self {
        let mut s = Self::new(plan, layer);
        s.processed = position;
        s.window.rows = carry.window.clone();
        if let Some(p) = s.pools.as_mut() {
            p.base = position / p.ratio;
            p.pending_kv = carry.pending_kv.clone();
            p.pending_gate = carry.pending_gate.clone();
        }
        s
    }
}

/// DeepSeek-V4.1's cache for every layer of one request, built from attention inputs.
pub struct V41CacheBuilder {
    weights: Arc<V41Weights>,
    layers: Vec<V41LayerState>,
    /// The position the state was resumed at (0: built from the first token); rows before it
    /// are ignored when fed again.
    origin: usize,
}

impl V41CacheBuilder {
    pub fn new(weights: Arc<V41Weights>) -> Self {
        let layers = (0..weights.plan.num_layers).map(|i| V41LayerState::new(&weights.plan, i)).collect();
        V41CacheBuilder { weights, layers, origin: 0 }
    }

    /// The state after `carry.position` tokens, from a carry state made with these weights
    /// (refused, naming what, otherwise).
    pub fn resume(weights: Arc<V41Weights>, carry: &V41Carry) -> Result<Self> {
        carry.check(&weights.fingerprint, &weights.plan)?;
        let layers = carry.layers.iter().enumerate().map(|(i, c)| V41LayerState::resume(&weights.plan, i, c, carry.position)).collect();
        Ok(V41CacheBuilder { origin: carry.position, weights, layers })
    }

    /// The carry state after the tokens every layer has processed (all must agree): what a
    /// later capture needs to continue from there.
    pub fn carry(&self) -> Result<V41Carry> {
        let position = self.layers.first().map_or(0, V41LayerState::processed);
        if let Some((i, l)) = self.layers.iter().enumerate().find(|(_, l)| l.processed() != position) {
            return Err(CoreError::input(i, format!("has processed {} tokens, layer 0 {position}", l.processed())));
        }
        Ok(V41Carry { fingerprint: self.weights.fingerprint.clone(), position, layers: self.layers.iter().map(V41LayerState::carry).collect() })
    }

    pub fn weights(&self) -> &Arc<V41Weights> {
        &self.weights
    }

    pub fn origin(&self) -> usize {
        self.origin
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn hidden_size(&self) -> usize {
        self.weights.plan.hidden_size
    }

    pub fn processed(&self, layer: usize) -> Option<usize> {
        self.layers.get(layer).map(V41LayerState::processed)
    }

    pub fn layer(&self, layer: usize) -> Option<&V41LayerState> {
        self.layers.get(layer)
    }

    /// Fold `rows` tokens of `layer`'s attention input (`[rows, hidden]` bf16, row-major), the
    /// first at absolute position `start`, into its state; chunks of a layer are contiguous. A
    /// resumed state ignores the rows before its [`Self::origin`].
    pub fn feed(&mut self, layer: usize, start: usize, x: &[bf16]) -> Result<()> {
        let hidden = self.weights.plan.hidden_size;
        let n = self.layers.len();
        let origin = self.origin;
        let state = self.layers.get_mut(layer).ok_or_else(|| CoreError::input(layer, format!("the model has {n} layers")))?;
        let Some((start, x)) = chunk::admit(layer, hidden, origin, state.processed(), start, x)? else {
            return Ok(());
        };
        state.feed(&self.weights.layers[layer], start, x.len() / hidden, x);
        Ok(())
    }
}
