//! What one oMLX block file carries, built from the pooler's layer states: the tensors and the
//! metadata, in the order and with the markers oMLX 0.7's `save_block` produces.
//!
//! DeepSeek-V4 layers are not sliceable, so every block (oMLX keeps a boundary snapshot at each
//! block) holds the full state at its end: a ratio-0 layer its last `sliding_window` rows; a
//! compressed layer a `CacheList` of the raw rotating buffer and the pools (`None` remainders
//! stored as markers). MLA layers are plain `KVCache`s: each block holds its own token slice.

use half::bf16;

use super::chain::ChainHash;
use super::file::Tensor;
use super::pyjson::{Json, DEFAULT};
use crate::error::{CoreError, Result};
use crate::pooler::{LayerState, MlaLayerState, StateArray, V4LayerState};

/// oMLX's block format version this layout reproduces.
pub const FORMAT_VERSION: &str = "3";

/// The tensors and metadata of one block.
pub struct BlockContents {
    pub tensors: Vec<Tensor>,
    pub metadata: Vec<(String, String)>,
}

/// Collects one layer's (or sub-cache's) state elements with oMLX's naming and markers.
struct Collector {
    tensors: Vec<Tensor>,
    layer_meta: Vec<(String, String)>,
}

impl Collector {
    /// `elements` are the state tuple: a tensor, a zero-width tensor (`zero_dim` shape) or None.
    fn state(&mut self, prefix: &str, elements: Vec<Element>) {
        self.layer_meta.push((format!("{prefix}_state_count"), elements.len().to_string()));
        for (k, e) in elements.into_iter().enumerate() {
            let name = format!("{prefix}_state_{k}");
            match e {
                Element::Tensor { shape, data } => {
                    self.tensors.push(Tensor { name, dtype: "BF16", shape, data: bf16_bytes(&data) });
                }
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

enum Element {
    Tensor { shape: Vec<usize>, data: Vec<bf16> },
    ZeroDim(Vec<usize>),
    None,
}

fn bf16_bytes(v: &[bf16]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 2);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// A rotating window as `(keys [1,1,rows,hd], values [1,1,rows,0])` and its meta state.
fn rotating(window: StateArray, size: usize, offset: usize) -> (Vec<Element>, Json) {
    let rows = window.shape[0];
    let meta = Json::List(["0".to_string(), size.to_string(), offset.to_string(), rows.to_string()].into_iter().map(Json::Str).collect());
    let elements = vec![
        Element::Tensor { shape: vec![1, 1, rows, window.shape[1]], data: window.data },
        Element::ZeroDim(vec![1, 1, rows, 0]),
    ];
    (elements, meta)
}

/// `(buf_kv, buf_gate, pooled)` of a `PoolingCache`: empty remainders are None.
fn pooling(arrays: &[StateArray], prefix: &str) -> Vec<Element> {
    let get = |n: &str| arrays.iter().find(|a| a.name.strip_prefix(prefix) == Some(n));
    ["buf_kv", "buf_gate", "pooled"]
        .into_iter()
        .map(|n| match get(n) {
            Some(a) if a.shape[0] > 0 => Element::Tensor { shape: vec![1, a.shape[0], a.shape[1]], data: a.data.clone() },
            _ => Element::None,
        })
        .collect()
}

fn v4_layer(i: usize, s: &V4LayerState, c: &mut Collector) -> (Json, Json) {
    let offset = s.processed();
    if !s.is_cache_list() {
        let snap = s.snapshot();
        let window = snap.into_iter().next().expect("a V4 layer always has a window");
        let (elements, meta) = rotating(window, s.sliding_window(), offset);
        c.state(&format!("layer_{i}"), elements);
        return (Json::str("RotatingKVCache"), meta);
    }
    let snap = s.snapshot();
    let (win, win_meta) = rotating(s.raw_window(), s.sliding_window(), offset);
    let mut subs = vec![win];
    let mut names = vec![Json::str("RotatingKVCache")];
    let mut metas = vec![win_meta];
    let ratio = Json::Int(s.ratio() as i64);
    subs.push(pooling(&snap, ""));
    names.push(Json::str("PoolingCache"));
    metas.push(ratio.clone());
    if snap.iter().any(|a| a.name == "idx_pooled") {
        subs.push(pooling(&snap, "idx_"));
        names.push(Json::str("PoolingCache"));
        metas.push(ratio);
    }
    c.layer_meta.push((format!("layer_{i}_sub_count"), subs.len().to_string()));
    for (j, elements) in subs.into_iter().enumerate() {
        c.state(&format!("layer_{i}_sub_{j}"), elements);
    }
    (Json::str("CacheList"), Json::List(vec![Json::List(names), Json::List(metas)]))
}

fn mla_layer(i: usize, s: &MlaLayerState, start: usize, end: usize, c: &mut Collector) -> (Json, Json) {
    let (latent, k_pe) = s.rows(start, end);
    c.state(
        &format!("layer_{i}"),
        vec![
            Element::Tensor { shape: vec![1, 1, end - start, latent.len() / (end - start)], data: latent },
            Element::Tensor { shape: vec![1, 1, end - start, k_pe.len() / (end - start)], data: k_pe },
        ],
    );
    (Json::str("KVCache"), Json::List(vec![]))
}

/// The block covering tokens `[start, end)`, from layer states that have processed exactly
/// `end` tokens.
pub fn block_contents(model_name: &str, hash: &ChainHash, layers: &[LayerState], start: usize, end: usize, created_at: f64) -> Result<BlockContents> {
    if end <= start {
        return Err(CoreError::input(0, format!("empty block [{start}, {end})")));
    }
    let mut c = Collector { tensors: Vec::new(), layer_meta: Vec::new() };
    let mut types = Vec::with_capacity(layers.len());
    let mut metas = Vec::with_capacity(layers.len());
    for (i, layer) in layers.iter().enumerate() {
        let processed = match layer {
            LayerState::V4(s) => s.processed(),
            LayerState::Mla(s) => s.processed(),
        };
        if processed != end {
            return Err(CoreError::input(i, format!("has processed {processed} tokens; the block ends at {end}")));
        }
        let (t, m) = match layer {
            LayerState::V4(s) => v4_layer(i, s, &mut c),
            LayerState::Mla(s) => mla_layer(i, s, start, end, &mut c),
        };
        types.push(t);
        metas.push(m);
    }
    let mut metadata = vec![
        ("omlx_cache_format_version".to_string(), FORMAT_VERSION.to_string()),
        ("block_hash".to_string(), hash.hex()),
        ("token_count".to_string(), (end - start).to_string()),
        ("num_layers".to_string(), layers.len().to_string()),
        ("model_name".to_string(), model_name.to_string()),
        ("created_at".to_string(), format!("{created_at}")),
        ("layer_cache_types".to_string(), Json::List(types).dumps(DEFAULT)),
        ("layer_meta_states".to_string(), Json::List(metas).dumps(DEFAULT)),
    ];
    metadata.extend(c.layer_meta);
    Ok(BlockContents { tensors: c.tensors, metadata })
}
