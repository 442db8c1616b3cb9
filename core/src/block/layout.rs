//! What one oMLX block file carries, built from the pooler's layer states: the tensors and the
//! metadata, in the order and with the markers the oMLX of an [`OmlxFormat`] writes them.
//!
//! DeepSeek-V4 layers are not sliceable, so every block (oMLX keeps a boundary snapshot at each
//! block) holds the state at its end: a ratio-0 layer its last `sliding_window` rows; a
//! compressed layer a `CacheList` of its window (the fork: the raw rotating buffer; upstream:
//! the last `sliding_window` rows) and the pools (`None` remainders stored as markers) — the
//! fork's `PoolingCache` with the whole pool, upstream's `PoolingCacheDelta` with the rows new
//! in this block, the previous ratio-4 window and the row range. MLA layers are plain
//! `KVCache`s: each block holds its own token slice. Upstream blocks also carry `block_size`,
//! `cache_signature` and `payload_layout`.

use half::bf16;

use super::chain::ChainHash;
use super::file::{Tensor, TensorData};
use super::pyjson::{Json, COMPACT_SORTED, DEFAULT};
use crate::error::{CoreError, Result};
use crate::format::{OmlxFormat, PoolLayout};
use crate::geometry::pooled_range;
use crate::pooler::LayerState;
use crate::view::{ArrayView, LayerView, V4BlockView};

/// The tensors and metadata of one block.
pub struct BlockContents<'a> {
    pub tensors: Vec<Tensor<'a>>,
    pub metadata: Vec<(String, String)>,
}

enum Element<'a> {
    /// A bf16 tensor of this shape.
    Tensor(Vec<usize>, &'a [bf16]),
    /// A zero-width tensor: stored as a float32 zero plus a `_zero_dim` marker.
    ZeroDim(Vec<usize>),
    /// `None`: a float32 zero plus a `_none` marker.
    None,
    /// An `I64 [2]` (a `PoolingCacheDelta`'s absolute row range).
    Range([i64; 2]),
}

/// Collects state elements with oMLX's naming and markers (count first, then markers).
struct Collector<'a> {
    tensors: Vec<Tensor<'a>>,
    layer_meta: Vec<(String, String)>,
    /// `cachelist_subtypes` of the cache signature, per `CacheList` layer.
    subtypes: Vec<(String, Json)>,
}

impl<'a> Collector<'a> {
    fn state(&mut self, prefix: &str, class_name: Option<&str>, elements: Vec<Element<'a>>) {
        if let Some(class) = class_name {
            self.layer_meta.push((format!("{prefix}_state_class_name"), class.to_string()));
        }
        self.layer_meta.push((format!("{prefix}_state_count"), elements.len().to_string()));
        for (k, e) in elements.into_iter().enumerate() {
            let name = format!("{prefix}_state_{k}");
            match e {
                Element::Tensor(shape, data) => self.tensors.push(Tensor { name, dtype: "BF16", shape, data: TensorData::Bf16(data) }),
                Element::ZeroDim(shape) => {
                    let dims = shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
                    self.layer_meta.push((format!("{name}_zero_dim"), dims));
                    self.tensors.push(Tensor::zero_f32(name));
                }
                Element::None => {
                    self.layer_meta.push((format!("{name}_none"), "1".into()));
                    self.tensors.push(Tensor::zero_f32(name));
                }
                Element::Range(r) => self.tensors.push(Tensor { name, dtype: "I64", shape: vec![2], data: TensorData::I64Pair(r) }),
            }
        }
    }
}

/// A rotating window as `(keys [1,1,rows,hd], values [1,1,rows,0])` and its meta state.
fn rotating<'a>(v: &V4BlockView<'a>) -> (Vec<Element<'a>>, Json) {
    let rows = v.window.rows;
    let meta = Json::List([0, v.sliding_window, v.offset, rows].into_iter().map(|n| Json::Str(n.to_string())).collect());
    (vec![Element::Tensor(vec![1, 1, rows, v.window.width], v.window.data), Element::ZeroDim(vec![1, 1, rows, 0])], meta)
}

/// `(buf_kv, buf_gate, pooled)` of a `PoolingCache`, each `[1, rows, width]`; empty ones None.
fn pooling<'a>(arrays: &[ArrayView<'a>; 3]) -> Vec<Element<'a>> {
    arrays.iter().map(|a| if a.rows > 0 { Element::Tensor(vec![1, a.rows, a.width], a.data) } else { Element::None }).collect()
}

/// A `PoolingCacheDelta` (upstream): the remainders, only the pooled rows new in this block,
/// the previous ratio-4 window (`[1, 1, ratio, out_dim]` each, None without one) and the
/// block's absolute pooled-row range as an `I64 [2]`.
fn pooling_delta<'a>(layer: usize, v: &V4BlockView<'a>, j: usize, ratio: usize, block_size: usize) -> Result<Vec<Element<'a>>> {
    let [kv, gate, pooled] = &v.pools[j];
    let first = v.pool_first.get(j).copied().unwrap_or(0);
    let (start, end) = pooled_range(ratio, block_size, v.offset);
    if first > start || first + pooled.rows != end {
        return Err(CoreError::input(layer, format!("pool {j} holds rows [{first}, {}), the block's delta is [{start}, {end})", first + pooled.rows)));
    }
    let delta = &pooled.data[(start - first) * pooled.width..(end - first) * pooled.width];
    let mut out = pooling(&[*kv, *gate, ArrayView { rows: end - start, width: pooled.width, data: delta }]);
    match v.prev.get(j).copied().flatten() {
        Some([pk, pg]) => {
            out.push(Element::Tensor(vec![1, 1, pk.rows, pk.width], pk.data));
            out.push(Element::Tensor(vec![1, 1, pg.rows, pg.width], pg.data));
        }
        None => out.extend([Element::None, Element::None]),
    }
    out.push(Element::Range([start as i64, end as i64]));
    Ok(out)
}

fn v4_layer<'a>(i: usize, v: &V4BlockView<'a>, f: OmlxFormat, block_size: usize, c: &mut Collector<'a>) -> Result<(Json, Json)> {
    let (window, window_meta) = rotating(v);
    if v.pools.is_empty() {
        c.state(&format!("layer_{i}"), None, window);
        return Ok((Json::str("RotatingKVCache"), window_meta));
    }
    let mut names = vec![Json::str("RotatingKVCache")];
    let mut metas = vec![window_meta];
    let mut subs = vec![(None, window)];
    let mut descriptors = vec![Json::str("RotatingKVCache")];
    for j in 0..v.pools.len() {
        names.push(Json::str("PoolingCache"));
        metas.push(Json::Int(v.ratio as i64));
        match f.pool_layout() {
            PoolLayout::Full => {
                let first = v.pool_first.get(j).copied().unwrap_or(0);
                if first != 0 {
                    return Err(CoreError::input(i, format!("pool {j} is a delta from row {first}; a full-pool block needs its earlier rows")));
                }
                subs.push((None, pooling(&v.pools[j])))
            }
            PoolLayout::Delta => subs.push((Some("PoolingCacheDelta"), pooling_delta(i, v, j, v.ratio, block_size)?)),
        }
        // The logical `PoolingCache` state arity upstream stamps: 5 (the delta's range aside).
        descriptors.push(Json::str("PoolingCache:5"));
    }
    c.layer_meta.push((format!("layer_{i}_sub_count"), subs.len().to_string()));
    for (j, (class, elements)) in subs.into_iter().enumerate() {
        c.state(&format!("layer_{i}_sub_{j}"), class, elements);
    }
    c.subtypes.push((i.to_string(), Json::List(descriptors)));
    Ok((Json::str("CacheList"), Json::List(vec![Json::List(names), Json::List(metas)])))
}

fn kv_layer<'a>(i: usize, keys: &ArrayView<'a>, values: &ArrayView<'a>, c: &mut Collector<'a>) -> (Json, Json) {
    c.state(
        &format!("layer_{i}"),
        None,
        vec![Element::Tensor(vec![1, 1, keys.rows, keys.width], keys.data), Element::Tensor(vec![1, 1, values.rows, values.width], values.data)],
    );
    (Json::str("KVCache"), Json::List(vec![]))
}

/// The tensors and metadata of a block of `token_count` tokens from per-layer views, as the
/// oMLX of `format` writes it.
pub fn contents<'a>(format: OmlxFormat, model_name: &str, hash: &ChainHash, token_count: usize, layers: &[LayerView<'a>], created_at: f64) -> Result<BlockContents<'a>> {
    let mut c = Collector { tensors: Vec::new(), layer_meta: Vec::new(), subtypes: Vec::new() };
    let mut types = Vec::with_capacity(layers.len());
    let mut metas = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let (t, m) = match layer {
            LayerView::V4(v) => v4_layer(i, v, format, token_count, &mut c)?,
            LayerView::Kv(k, v) => kv_layer(i, k, v, &mut c),
        };
        types.push(t);
        metas.push(m);
    }
    let types = Json::List(types);
    let mut metadata = vec![
        ("omlx_cache_format_version".to_string(), format.write_version().to_string()),
        ("block_hash".to_string(), hash.hex()),
        ("token_count".to_string(), token_count.to_string()),
        ("num_layers".to_string(), layers.len().to_string()),
        ("model_name".to_string(), model_name.to_string()),
    ];
    if let Some(layout) = format.payload_layout() {
        metadata.push(("block_size".to_string(), token_count.to_string()));
        metadata.push(("cache_signature".to_string(), cache_signature(model_name, layers.len(), token_count, &types, c.subtypes, layout)));
        metadata.push(("payload_layout".to_string(), layout.to_string()));
    }
    metadata.extend([
        ("created_at".to_string(), format!("{created_at}")),
        ("layer_cache_types".to_string(), types.dumps(DEFAULT)),
        ("layer_meta_states".to_string(), Json::List(metas).dumps(DEFAULT)),
    ]);
    metadata.extend(c.layer_meta);
    Ok(BlockContents { tensors: c.tensors, metadata })
}

/// Upstream's `_cache_compat_signature`: compact, key-sorted JSON of the model name, layer
/// count, block size, layer types, the sub composition of `CacheList` layers with a
/// non-sliceable sub (all of DeepSeek-V4's) and the payload layout.
pub fn cache_signature(model_name: &str, num_layers: usize, block_size: usize, types: &Json, subtypes: Vec<(String, Json)>, layout: &str) -> String {
    let mut sig = vec![
        ("model_name".to_string(), Json::str(model_name)),
        ("num_layers".to_string(), Json::Int(num_layers as i64)),
        ("block_size".to_string(), Json::Int(block_size as i64)),
        ("layer_cache_types".to_string(), types.clone()),
    ];
    if !subtypes.is_empty() {
        sig.push(("cachelist_subtypes".to_string(), Json::Obj(subtypes)));
    }
    sig.push(("payload_layout".to_string(), Json::str(layout)));
    Json::Obj(sig).dumps(COMPACT_SORTED)
}

/// The block covering tokens `[start, end)`, from pooler layer states that have processed
/// exactly `end` tokens.
pub fn block_contents<'a>(format: OmlxFormat, model_name: &str, hash: &ChainHash, layers: &'a [LayerState], start: usize, end: usize, created_at: f64) -> Result<BlockContents<'a>> {
    if end <= start {
        return Err(CoreError::input(0, format!("empty block [{start}, {end})")));
    }
    let mut views = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let processed = layer.processed();
        if processed != end {
            return Err(CoreError::input(i, format!("has processed {processed} tokens; the block ends at {end}")));
        }
        views.push(layer.view(start, end));
    }
    contents(format, model_name, hash, end - start, &views, created_at)
}
