//! Reading a carry state ([`crate::pooler::carry`]) out of what holds it: the oMLX block file the
//! decode host has (validated as oMLX would load it first, then read the way oMLX's
//! reconstruction reads it), a block's per-layer views, or pooler layers at a block boundary.
//!
//! It lives with the blocks because it reads their files; the carry state itself (its bytes, its
//! check against a plan) lives with the pooler it continues.

use std::fs::File;
use std::path::Path;

use half::bf16;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::chain::ChainHash;
use super::validate::{inspect, Expect};
use crate::error::{CarryField, CoreError, Result};
use crate::format::{OmlxFormat, PoolLayout};
use crate::family;
use crate::geometry::{pool_out_dim, Geometry, LayerShape};
use crate::plan::ModelPlan;
use crate::pooler::carry::{err, CarryState, LayerCarry, PoolCarry, V4Carry};
use crate::pooler::LayerState;
use crate::view::LayerView;

impl CarryState {
    /// The carry state of pooler layers that have all processed exactly `S` tokens (a block
    /// boundary): what the block ending at `S` holds, as [`LayerState::view`] sees it.
    pub fn from_layers(format: OmlxFormat, fingerprint: &str, block_size: usize, chain_hash: Option<ChainHash>, layers: &[LayerState]) -> Result<CarryState> {
        let position = layers.first().map_or(0, LayerState::processed);
        if let Some((i, l)) = layers.iter().enumerate().find(|(_, l)| l.processed() != position) {
            return Err(CoreError::input(i, format!("has processed {} tokens, layer 0 {position}", l.processed())));
        }
        let start = position.saturating_sub(block_size);
        let views: Vec<LayerView<'_>> = layers.iter().map(|l| l.view(start, position)).collect();
        Ok(Self::from_views(format, fingerprint, block_size, position, chain_hash, &views))
    }

    /// The carry state of a block's per-layer views (a block at its end boundary `position`).
    /// Nothing is checked here; [`CarryState::check`] does it.
    pub fn from_views(format: OmlxFormat, fingerprint: &str, block_size: usize, position: usize, chain_hash: Option<ChainHash>, views: &[LayerView<'_>]) -> CarryState {
        let layers = views
            .iter()
            .map(|v| match v {
                LayerView::V4(v) => LayerCarry::V4(V4Carry {
                    sliding_window: v.sliding_window,
                    ratio: v.ratio,
                    head_dim: v.window.width,
                    window: v.window.data.to_vec(),
                    pools: v
                        .pools
                        .iter()
                        .enumerate()
                        .map(|(j, [kv, gate, pooled])| PoolCarry {
                            width: kv.width,
                            pooled_rows: v.pool_first.get(j).copied().unwrap_or(0) + pooled.rows,
                            buf_kv: kv.data.to_vec(),
                            buf_gate: gate.data.to_vec(),
                            prev: v.prev.get(j).copied().flatten().map(|[k, g]| [k.data.to_vec(), g.data.to_vec()]),
                        })
                        .collect(),
                }),
                LayerView::Kv(..) => LayerCarry::Kv,
            })
            .collect();
        CarryState { format, fingerprint: fingerprint.into(), block_size, position, chain_hash, layers }
    }

    /// Read the carry state out of the oMLX block file that ends at token `position`, for the
    /// decoder whose `plan` and `fingerprint` are given (the decode host's own weights). The file
    /// is validated as oMLX would load it first; every array is checked against the plan, the
    /// format and the position (a block's window offset and pool row range say where it ends).
    pub fn from_block_file(path: &Path, plan: &ModelPlan, fingerprint: &str, format: OmlxFormat, block_size: usize, position: usize) -> Result<CarryState> {
        let expect = Expect { format, model_name: None, num_layers: Some(plan.num_layers()), block_size: Some(block_size) };
        let info = inspect(path, &expect).map_err(|why| err(CarryField::Block, format!("{}: {why}", path.display())))?;
        let file = File::open(path).map_err(|e| CoreError::io(path, e))?;
        // SAFETY: blocks are immutable once named (writers rename complete files into place).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| CoreError::io(path, e))?;
        let block = BlockFile::parse(&map).map_err(|why| err(CarryField::Block, format!("{}: {why}", path.display())))?;
        let geometry = family::geometry(plan, format, block_size);
        let layers = geometry
            .layers
            .iter()
            .enumerate()
            .map(|(i, shape)| block.layer(i, shape, &geometry, position))
            .collect::<std::result::Result<Vec<_>, CoreError>>()?;
        let carry = CarryState { format, fingerprint: fingerprint.into(), block_size, position, chain_hash: Some(info.hash), layers };
        carry.check(&geometry)?;
        Ok(carry)
    }
}

/// One element of a cache state as a block file stores it.
enum Element<'a> {
    /// `None` or a zero-size array (oMLX stores both as a float32 zero plus a marker).
    Empty,
    Bf16(Vec<usize>, &'a [u8]),
    I64(Vec<i64>),
}

/// A block file's tensors and metadata, read the way oMLX's reconstruction reads them.
struct BlockFile<'a> {
    st: SafeTensors<'a>,
    meta: std::collections::HashMap<String, String>,
    types: Vec<Value>,
    metas: Vec<Value>,
}

impl<'a> BlockFile<'a> {
    fn parse(bytes: &'a [u8]) -> std::result::Result<Self, String> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| format!("not a valid safetensors file: {e}"))?;
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| format!("not a valid safetensors file: {e}"))?;
        let meta = header.metadata().clone().ok_or("has no __metadata__")?;
        let list = |k: &str| -> std::result::Result<Vec<Value>, String> {
            let text = meta.get(k).ok_or_else(|| format!("metadata has no {k}"))?;
            match serde_json::from_str(text) {
                Ok(Value::Array(a)) => Ok(a),
                _ => Err(format!("metadata {k} is not a JSON list")),
            }
        };
        let (types, metas) = (list("layer_cache_types")?, list("layer_meta_states")?);
        Ok(BlockFile { st, meta, types, metas })
    }

    fn element(&self, prefix: &str, k: usize) -> std::result::Result<Element<'a>, String> {
        let name = format!("{prefix}_state_{k}");
        if self.meta.contains_key(&format!("{name}_none")) || self.meta.contains_key(&format!("{name}_zero_dim")) {
            return Ok(Element::Empty);
        }
        let t = self.st.tensor(&name).map_err(|_| format!("tensor {name} is missing"))?;
        match t.dtype() {
            Dtype::BF16 => Ok(Element::Bf16(t.shape().to_vec(), t.data())),
            Dtype::I64 => Ok(Element::I64(t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect())),
            other => Err(format!("tensor {name} is {other:?}, expected BF16")),
        }
    }

    fn count(&self, key: &str) -> std::result::Result<usize, String> {
        self.meta.get(key).and_then(|v| v.parse().ok()).ok_or_else(|| format!("metadata {key} is missing or not an integer"))
    }

    /// A `[1, …, rows, width]` bf16 array as `(rows, width, values)`; an empty element is 0 rows.
    fn rows(&self, prefix: &str, k: usize, lead: usize) -> std::result::Result<(usize, usize, Vec<bf16>), String> {
        match self.element(prefix, k)? {
            Element::Empty => Ok((0, 0, Vec::new())),
            Element::Bf16(shape, data) => {
                if shape.len() != lead + 2 || shape[..lead].iter().any(|&d| d != 1) {
                    return Err(format!("{prefix}_state_{k} has shape {shape:?}"));
                }
                let v = data.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect();
                Ok((shape[lead], shape[lead + 1], v))
            }
            Element::I64(_) => Err(format!("{prefix}_state_{k} is an integer tensor, expected rows")),
        }
    }

    /// Layer `i`'s carry, checked against what the decoder's layer `want` holds at `position`.
    fn layer(&self, i: usize, want: &LayerShape, geometry: &Geometry, position: usize) -> Result<LayerCarry> {
        let block_size = geometry.block_size;
        let block = |r: String| err(CarryField::Block, format!("layer {i}: {r}"));
        let ty = self.types.get(i).and_then(Value::as_str).unwrap_or("?");
        let LayerShape::Windowed { sliding_window, ratio, head_dim, pool_heads } = want else {
            if ty != "KVCache" {
                return Err(err(CarryField::Plan, format!("layer {i} is a {ty}, the model's is a KVCache")));
            }
            // Each KV block holds exactly its own tokens.
            let (rows, _, _) = self.rows(&format!("layer_{i}"), 0, 2).map_err(block)?;
            if rows != block_size {
                return Err(block(format!("holds {rows} key rows, the block size is {block_size}")));
            }
            return Ok(LayerCarry::Kv);
        };
        let (ratio, head_dim, sliding_window) = (*ratio, *head_dim, *sliding_window);
        let want_ty = if ratio == 0 { "RotatingKVCache" } else { "CacheList" };
        if ty != want_ty {
            return Err(err(CarryField::Plan, format!("layer {i} is a {ty}, the model's ratio-{ratio} layer is a {want_ty}")));
        }
        let (window_prefix, window_meta) = if ratio == 0 {
            (format!("layer_{i}"), self.metas.get(i))
        } else {
            let subs = self.count(&format!("layer_{i}_sub_count")).map_err(block)?;
            if subs != 1 + pool_heads.len() {
                return Err(err(CarryField::Plan, format!("layer {i} has {} pools, the model's has {}", subs.saturating_sub(1), pool_heads.len())));
            }
            (format!("layer_{i}_sub_0"), self.metas.get(i).and_then(|m| m.get(1)).and_then(|m| m.get(0)))
        };
        // RotatingKVCache meta state: [keep, max_size, offset, _idx] as strings.
        let field = |k: usize| window_meta.and_then(|m| m.get(k)).and_then(Value::as_str).and_then(|s| s.parse::<usize>().ok());
        let (max_size, offset) = (field(1), field(2));
        if max_size != Some(sliding_window) {
            return Err(err(CarryField::Plan, format!("layer {i}: window of max size {max_size:?}, the model's is {sliding_window}")));
        }
        if offset != Some(position) {
            return Err(err(CarryField::Position, format!("layer {i}: the block's window ends at token {offset:?}, not {position}")));
        }
        let (_, width, window) = self.rows(&window_prefix, 0, 2).map_err(block)?;
        if width != head_dim && !window.is_empty() {
            return Err(err(CarryField::Plan, format!("layer {i}: window rows of width {width}, the model's are {head_dim}")));
        }
        let mut out = Vec::with_capacity(pool_heads.len());
        for (j, &head) in pool_heads.iter().enumerate() {
            let width = pool_out_dim(ratio, head);
            let prefix = format!("layer_{i}_sub_{}", j + 1);
            let n = self.count(&format!("{prefix}_state_count")).map_err(block)?;
            let (kv, gate) = (self.rows(&prefix, 0, 1).map_err(block)?, self.rows(&prefix, 1, 1).map_err(block)?);
            let (pooled_rows, prev) = match geometry.format.pool_layout() {
                PoolLayout::Full => {
                    if n != 3 {
                        return Err(block(format!("pool {j} has {n} elements, a PoolingCache 3")));
                    }
                    (self.rows(&prefix, 2, 1).map_err(block)?.0, None)
                }
                PoolLayout::Delta => {
                    if n != 6 {
                        return Err(block(format!("pool {j} has {n} elements, a PoolingCacheDelta 6")));
                    }
                    let Element::I64(range) = self.element(&prefix, 5).map_err(block)? else {
                        return Err(block(format!("pool {j}: the row range is not an I64 tensor")));
                    };
                    let [start, end] = range[..] else { return Err(block(format!("pool {j}: a row range of {} values", range.len()))) };
                    let delta = self.rows(&prefix, 2, 1).map_err(block)?.0;
                    if start < 0 || end < start || (end - start) as usize != delta {
                        return Err(block(format!("pool {j}: row range [{start}, {end}) with {delta} pooled rows")));
                    }
                    let (pk, pg) = (self.rows(&prefix, 3, 2).map_err(block)?, self.rows(&prefix, 4, 2).map_err(block)?);
                    let prev = (pk.0 > 0 || pg.0 > 0).then_some([pk.2, pg.2]);
                    (end as usize, prev)
                }
            };
            for (name, w) in [("buf_kv", kv.1), ("buf_gate", gate.1)] {
                if w != 0 && w != width {
                    return Err(err(CarryField::Plan, format!("layer {i} pool {j}: {name} rows of width {w}, the model's are {width}")));
                }
            }
            out.push(PoolCarry { width, pooled_rows, buf_kv: kv.2, buf_gate: gate.2, prev });
        }
        Ok(LayerCarry::V4(V4Carry { sliding_window, ratio, head_dim, window, pools: out }))
    }
}
