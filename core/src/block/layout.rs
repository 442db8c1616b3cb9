//! What one oMLX block file carries, built from the pooler's layer states: the tensors and the
//! metadata, in the order and with the markers oMLX 0.7's `save_block` produces.
//!
//! DeepSeek-V4 layers are not sliceable, so every block (oMLX keeps a boundary snapshot at each
//! block) holds the full state at its end: a ratio-0 layer its last `sliding_window` rows; a
//! compressed layer a `CacheList` of the raw rotating buffer and the pools (`None` remainders
//! stored as markers). MLA layers are plain `KVCache`s: each block holds its own token slice.

use half::bf16;

use super::chain::ChainHash;
use super::file::{Tensor, TensorData};
use super::pyjson::{Json, DEFAULT};
use crate::error::{CoreError, Result};
use crate::pooler::{ArrayView, LayerState, V4BlockView};

/// oMLX's block format version this layout reproduces.
pub const FORMAT_VERSION: &str = "3";

/// One layer's state as a block stores it, borrowed from wherever it lives.
pub enum LayerView<'a> {
    /// DeepSeek-V4: a rotating window alone, or in a `CacheList` with its pools.
    V4(V4BlockView<'a>),
    /// A plain `KVCache` slice: `(keys [rows, dk], values [rows, dv])`.
    Kv(ArrayView<'a>, ArrayView<'a>),
}

impl<'a> LayerView<'a> {
    /// The view of a pooler layer state for the block `[start, end)`.
    pub fn of(layer: &'a LayerState, start: usize, end: usize) -> Self {
        match layer {
            LayerState::V4(s) => LayerView::V4(s.block_view()),
            LayerState::Mla(s) => {
                let (latent, k_pe) = s.rows(start, end);
                LayerView::Kv(latent, k_pe)
            }
        }
    }
}

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
}

/// Collects state elements with oMLX's naming and markers (count first, then markers).
struct Collector<'a> {
    tensors: Vec<Tensor<'a>>,
    layer_meta: Vec<(String, String)>,
}

impl<'a> Collector<'a> {
    fn state(&mut self, prefix: &str, elements: Vec<Element<'a>>) {
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

fn v4_layer<'a>(i: usize, v: &V4BlockView<'a>, c: &mut Collector<'a>) -> (Json, Json) {
    let (window, window_meta) = rotating(v);
    if v.pools.is_empty() {
        c.state(&format!("layer_{i}"), window);
        return (Json::str("RotatingKVCache"), window_meta);
    }
    let mut names = vec![Json::str("RotatingKVCache")];
    let mut metas = vec![window_meta];
    let mut subs = vec![window];
    for pool in &v.pools {
        names.push(Json::str("PoolingCache"));
        metas.push(Json::Int(v.ratio as i64));
        subs.push(pooling(pool));
    }
    c.layer_meta.push((format!("layer_{i}_sub_count"), subs.len().to_string()));
    for (j, elements) in subs.into_iter().enumerate() {
        c.state(&format!("layer_{i}_sub_{j}"), elements);
    }
    (Json::str("CacheList"), Json::List(vec![Json::List(names), Json::List(metas)]))
}

fn kv_layer<'a>(i: usize, keys: &ArrayView<'a>, values: &ArrayView<'a>, c: &mut Collector<'a>) -> (Json, Json) {
    c.state(
        &format!("layer_{i}"),
        vec![Element::Tensor(vec![1, 1, keys.rows, keys.width], keys.data), Element::Tensor(vec![1, 1, values.rows, values.width], values.data)],
    );
    (Json::str("KVCache"), Json::List(vec![]))
}

/// The tensors and metadata of a block of `token_count` tokens from per-layer views.
pub fn contents<'a>(model_name: &str, hash: &ChainHash, token_count: usize, layers: &[LayerView<'a>], created_at: f64) -> BlockContents<'a> {
    let mut c = Collector { tensors: Vec::new(), layer_meta: Vec::new() };
    let mut types = Vec::with_capacity(layers.len());
    let mut metas = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let (t, m) = match layer {
            LayerView::V4(v) => v4_layer(i, v, &mut c),
            LayerView::Kv(k, v) => kv_layer(i, k, v, &mut c),
        };
        types.push(t);
        metas.push(m);
    }
    let mut metadata = vec![
        ("omlx_cache_format_version".to_string(), FORMAT_VERSION.to_string()),
        ("block_hash".to_string(), hash.hex()),
        ("token_count".to_string(), token_count.to_string()),
        ("num_layers".to_string(), layers.len().to_string()),
        ("model_name".to_string(), model_name.to_string()),
        ("created_at".to_string(), format!("{created_at}")),
        ("layer_cache_types".to_string(), Json::List(types).dumps(DEFAULT)),
        ("layer_meta_states".to_string(), Json::List(metas).dumps(DEFAULT)),
    ];
    metadata.extend(c.layer_meta);
    BlockContents { tensors: c.tensors, metadata }
}

/// The block covering tokens `[start, end)`, from pooler layer states that have processed
/// exactly `end` tokens.
pub fn block_contents<'a>(model_name: &str, hash: &ChainHash, layers: &'a [LayerState], start: usize, end: usize, created_at: f64) -> Result<BlockContents<'a>> {
    if end <= start {
        return Err(CoreError::input(0, format!("empty block [{start}, {end})")));
    }
    let mut views = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let processed = match layer {
            LayerState::V4(s) => s.processed(),
            LayerState::Mla(s) => s.processed(),
        };
        if processed != end {
            return Err(CoreError::input(i, format!("has processed {processed} tokens; the block ends at {end}")));
        }
        views.push(LayerView::of(layer, start, end));
    }
    Ok(contents(model_name, hash, end - start, &views, created_at))
}
