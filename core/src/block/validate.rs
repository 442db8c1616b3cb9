//! The block validator: what must hold before oMLX may index (and so serve) a block file.
//!
//! It checks the file name; that the name is a regular file inside the cache directory (never
//! a symbolic or hard link, FIFO, device, socket or directory: it is opened without following
//! links and without blocking, and `fstat`ed before a byte is read, so a FIFO cannot hang it);
//! the safetensors framing (a truncated or garbled file fails here; only the header is read, no
//! mapping a concurrent truncation could fault); the format version oMLX reads; that the file's
//! `block_hash` is its name; the counts and per-layer tensors that oMLX's reconstruction will
//! look up; when the caller knows them the model, layer count and block size; and, given the
//! decoder's plan, every tensor's dtype and shape and the layer metadata, against exactly what
//! the block writer writes for that plan ([`super::spec`]). Every rejection says why, and what
//! kind of problem it is: a bad file on a block's name is moved aside ([`move_aside`]) so the
//! correct block can be written; a sound block of another model is left alone.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::tensor::{Dtype, Metadata};
use serde_json::Value;

use super::chain::ChainHash;
use super::file::TensorData;
use super::layout::contents;
use super::spec::StoreSpec;
use crate::format::{OmlxFormat, PoolLayout};
use crate::geometry::{pooled_range, LayerShape};
use crate::plan::ModelPlan;
use crate::view::{ArrayView, LayerView, V4BlockView};

/// Where bad files on a block's name are moved: inside the cache directory (same filesystem,
/// a rename), outside the `0`-`f` subdirectories oMLX scans and its sidecar directory.
pub const QUARANTINE_DIR: &str = ".pd-bridge-quarantine";

/// Largest block header read (safetensors allows 100 MB; a block's is a few KiB per layer).
const MAX_HEADER: u64 = 16 << 20;

/// What the caller expects of a block, where it knows.
#[derive(Clone, Debug, Default)]
pub struct Expect {
    /// The oMLX the block is for: its readable versions, signature and layout rules.
    pub format: OmlxFormat,
    pub model_name: Option<String>,
    pub num_layers: Option<usize>,
    pub block_size: Option<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct BlockInfo {
    pub hash: ChainHash,
    pub token_count: usize,
    pub num_layers: usize,
    pub model_name: String,
    pub file_size: u64,
}

/// What kind of problem a rejected file has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectKind {
    /// Not named like a block (oMLX's own `_tmp` files among them): never touched.
    Name,
    /// A symbolic link, hard link, FIFO, device, socket or directory on a block's name.
    NotRegular,
    /// Lies, through a linked directory, outside the cache directory: refused, not moved.
    Outside,
    /// A regular file on a block's name that is not a sound block: framing, metadata, hash,
    /// missing tensors, or dtypes and shapes the plan does not give.
    Corrupt,
    /// A sound block for another model, layer count, block size or oMLX format.
    Foreign,
    /// Could not be read at all (permissions, I/O).
    Unreadable,
}

/// Why a file must not be served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub kind: RejectKind,
    pub reason: String,
}

impl Rejection {
    fn new(kind: RejectKind, reason: impl Into<String>) -> Self {
        Rejection { kind, reason: reason.into() }
    }

    /// Whether the file is bad whoever it belongs to, so a scan may move it aside: it can
    /// never become a valid block, and left in place it would keep its name from the bridge.
    pub fn is_bad_file(&self) -> bool {
        matches!(self.kind, RejectKind::NotRegular | RejectKind::Corrupt)
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

fn corrupt(reason: impl Into<String>) -> Rejection {
    Rejection::new(RejectKind::Corrupt, reason)
}

fn foreign(reason: impl Into<String>) -> Rejection {
    Rejection::new(RejectKind::Foreign, reason)
}

impl From<String> for Rejection {
    fn from(reason: String) -> Self {
        corrupt(reason)
    }
}

impl From<&str> for Rejection {
    fn from(reason: &str) -> Self {
        corrupt(reason)
    }
}

fn file_type_name(m: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

/// The block file opened for reading, checked to be a regular file inside the cache directory.
fn open_regular(path: &Path, subdir: &str, cache_dir: Option<&Path>) -> Result<(File, u64), Rejection> {
    let not_regular = |r: String| Rejection::new(RejectKind::NotRegular, r);
    let lst = std::fs::symlink_metadata(path).map_err(|e| Rejection::new(RejectKind::Unreadable, format!("cannot stat: {e}")))?;
    if lst.file_type().is_symlink() {
        let to = std::fs::read_link(path).map(|t| format!(" to {}", t.display())).unwrap_or_default();
        return Err(not_regular(format!("is a symbolic link{to}, not a block file")));
    }
    if !lst.file_type().is_file() {
        return Err(not_regular(format!("is {}, not a block file", file_type_name(&lst))));
    }
    if lst.nlink() > 1 {
        return Err(not_regular(format!("has {} hard links; a block file has one", lst.nlink())));
    }
    // The real directory must be the cache directory's subdirectory: a linked subdirectory
    // would let a block name reach any file.
    let cache = cache_dir.or_else(|| path.parent().and_then(Path::parent));
    if let (Some(cache), Some(parent)) = (cache, path.parent()) {
        let real_cache = std::fs::canonicalize(&cache).map_err(|e| Rejection::new(RejectKind::Unreadable, format!("cache directory {}: {e}", cache.display())))?;
        let real_dir = std::fs::canonicalize(parent).map_err(|e| Rejection::new(RejectKind::Unreadable, format!("cannot resolve its directory: {e}")))?;
        if real_dir != real_cache.join(subdir) {
            return Err(Rejection::new(RejectKind::Outside, format!("resolves to {}, outside the cache directory {}", real_dir.display(), real_cache.display())));
        }
    }
    // O_NOFOLLOW: a link swapped in after the lstat fails to open; O_NONBLOCK: so does a FIFO
    // (opening one for reading would wait for a writer).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| if e.raw_os_error() == Some(libc::ELOOP) { not_regular("is a symbolic link, not a block file".into()) } else { Rejection::new(RejectKind::Unreadable, format!("cannot open: {e}")) })?;
    let st = file.metadata().map_err(|e| Rejection::new(RejectKind::Unreadable, format!("cannot stat: {e}")))?;
    if !st.file_type().is_file() || st.ino() != lst.ino() || st.dev() != lst.dev() {
        return Err(not_regular(format!("changed while being checked (now {})", if st.file_type().is_file() { "another file" } else { file_type_name(&st) })));
    }
    Ok((file, st.len()))
}

/// The safetensors header, read (not mapped) and checked to frame exactly the file's bytes.
fn read_header(file: &File, file_size: u64) -> Result<(u64, Metadata), Rejection> {
    if file_size < 8 {
        return Err(corrupt(format!("truncated: {file_size} bytes")));
    }
    let mut len = [0u8; 8];
    file.read_exact_at(&mut len, 0).map_err(|e| corrupt(format!("not a valid safetensors file: {e}")))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER || 8 + n > file_size {
        return Err(corrupt(format!("not a valid safetensors file: header of {n} bytes in a file of {file_size}")));
    }
    let mut head = vec![0u8; n as usize];
    file.read_exact_at(&mut head, 8).map_err(|e| corrupt(format!("not a valid safetensors file: {e}")))?;
    let meta: Metadata = serde_json::from_slice(&head).map_err(|e| corrupt(format!("not a valid safetensors file: {e}")))?;
    if meta.data_len() as u64 + 8 + n != file_size {
        return Err(corrupt(format!("not a valid safetensors file: tensors cover {} bytes, the file holds {}", meta.data_len(), file_size - 8 - n)));
    }
    Ok((n, meta))
}

/// Validate one block file; `Err` carries the reason it must not be served.
pub fn inspect(path: &Path, expect: &Expect) -> Result<BlockInfo, Rejection> {
    inspect_with(path, expect, None, None)
}

/// [`inspect`], knowing the decoder's `plan` (every tensor's dtype and shape are then checked)
/// and the `cache_dir` the block must lie in (default: the directory above its subdirectory).
pub fn inspect_with(path: &Path, expect: &Expect, plan: Option<&ModelPlan>, cache_dir: Option<&Path>) -> Result<BlockInfo, Rejection> {
    let name_err = |r: String| Rejection::new(RejectKind::Name, r);
    let name = path.file_name().and_then(|n| n.to_str()).ok_or_else(|| name_err("file name is not UTF-8".into()))?;
    let stem = name.strip_suffix(".safetensors").ok_or_else(|| name_err(format!("{name:?} is not a .safetensors block file")))?;
    let hash = ChainHash::from_hex(stem).filter(|_| stem.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    let hash = hash.ok_or_else(|| name_err(format!("{name:?} is not named by a 64-hex-digit block hash")))?;
    if let Some(dir) = path.parent().and_then(|d| d.file_name()).and_then(|d| d.to_str()) {
        if dir != &stem[..1] {
            return Err(name_err(format!("lies in directory {dir:?}, not {:?}", &stem[..1])));
        }
    }
    let (file, file_size) = open_regular(path, &stem[..1], cache_dir)?;
    let (header_len, header) = read_header(&file, file_size)?;
    let meta = header.metadata().as_ref().ok_or("has no __metadata__")?;
    let get = |k: &str| meta.get(k).map(String::as_str).ok_or_else(|| format!("metadata has no {k}"));

    let version = get("omlx_cache_format_version")?;
    let readable = expect.format.readable_versions();
    if !readable.contains(&version) {
        return Err(foreign(format!("format version {version:?} is not supported by {} (readable: {readable:?})", expect.format)));
    }
    let stated = get("block_hash")?;
    if stated != stem {
        return Err(corrupt(format!("metadata block_hash {stated} does not match the file name")));
    }
    let number = |k: &str| -> Result<usize, String> { get(k)?.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| format!("metadata {k} is not a positive integer")) };
    let token_count = number("token_count")?;
    let num_layers = number("num_layers")?;
    let model_name = get("model_name")?.to_string();
    if let Some(m) = &expect.model_name {
        if &model_name != m {
            return Err(foreign(format!("belongs to model {model_name:?}, not {m:?}")));
        }
    }
    if let Some(n) = expect.num_layers {
        if num_layers != n {
            return Err(foreign(format!("has {num_layers} layers, the model has {n}")));
        }
    }
    if let Some(b) = expect.block_size {
        if token_count != b {
            return Err(foreign(format!("holds {token_count} tokens, the block size is {b}")));
        }
    }

    let types: Value = serde_json::from_str(get("layer_cache_types")?).map_err(|e| format!("layer_cache_types is not JSON: {e}"))?;
    if let Some(layout) = expect.format.payload_layout() {
        check_signature(&get, layout, &model_name, num_layers, token_count, &types).map_err(foreign)?;
    }

    // Every tensor oMLX's reconstruction will ask for must be there.
    let types = types.as_array().ok_or("layer_cache_types is not a list")?;
    if types.len() != num_layers {
        return Err(corrupt(format!("layer_cache_types lists {} layers, num_layers says {num_layers}", types.len())));
    }
    let tensors = header.tensors();
    let names: HashSet<&str> = tensors.keys().map(String::as_str).collect();
    let count = |k: &str| -> Result<usize, String> { get(k)?.parse::<usize>().map_err(|_| format!("metadata {k} is not an integer")) };
    let need = |prefix: &str| -> Result<(), String> {
        for k in 0..count(&format!("{prefix}_state_count"))? {
            let t = format!("{prefix}_state_{k}");
            if !names.contains(t.as_str()) {
                return Err(format!("tensor {t} is missing"));
            }
        }
        Ok(())
    };
    for (i, t) in types.iter().enumerate() {
        if t.as_str() == Some("CacheList") {
            for j in 0..count(&format!("layer_{i}_sub_count"))? {
                need(&format!("layer_{i}_sub_{j}"))?;
            }
        } else {
            need(&format!("layer_{i}"))?;
        }
    }
    if let Some(plan) = plan {
        if plan.num_layers() != num_layers {
            return Err(foreign(format!("has {num_layers} layers, the model has {}", plan.num_layers())));
        }
        let spec = StoreSpec::new(plan, expect.format, token_count).map_err(|e| corrupt(e.to_string()))?;
        check_shapes(&spec, &file, header_len, &tensors, meta, &hash, &model_name)?;
    }
    Ok(BlockInfo { hash, token_count, num_layers, model_name, file_size })
}

/// A V4 layer's window rows (from its first tensor) and the block's end (from its meta state).
fn window_of(i: usize, spec: &LayerShape, tensors: &HashMap<String, &safetensors::tensor::TensorInfo>, metas: &[Value]) -> Result<(usize, usize), Rejection> {
    let LayerShape::Windowed { ratio, .. } = spec else { return Ok((0, 0)) };
    let name = if *ratio == 0 { format!("layer_{i}_state_0") } else { format!("layer_{i}_sub_0_state_0") };
    let info = tensors.get(&name).ok_or_else(|| corrupt(format!("layer {i}: tensor {name} is missing (a ratio-{ratio} layer)")))?;
    let rows = match info.shape.as_slice() {
        [1, 1, rows, _] => *rows,
        s => return Err(corrupt(format!("layer {i}: window {name} has shape {s:?}, expected [1, 1, rows, head_dim]"))),
    };
    // RotatingKVCache meta state: [keep, max_size, offset, idx]; a CacheList's is [[classes], [metas]].
    let m = metas.get(i).ok_or_else(|| corrupt(format!("layer_meta_states has no layer {i}")))?;
    let window_meta = if *ratio == 0 { Some(m) } else { m.get(1).and_then(|x| x.get(0)) };
    let offset = window_meta.and_then(|w| w.get(2)).and_then(|o| o.as_str().and_then(|s| s.parse().ok()).or_else(|| o.as_u64().map(|v| v as usize)));
    let offset = offset.ok_or_else(|| corrupt(format!("layer {i}: layer_meta_states has no window offset")))?;
    Ok((rows, offset))
}

/// Every tensor's dtype and shape and the layer metadata, against what the block writer writes
/// for this plan at the block's position (the delta layout's row range included).
fn check_shapes(spec: &StoreSpec, file: &File, header_len: u64, tensors: &HashMap<String, &safetensors::tensor::TensorInfo>, meta: &HashMap<String, String>, hash: &ChainHash, model_name: &str) -> Result<(), Rejection> {
    let b = spec.geometry.block_size;
    let metas: Vec<Value> = meta.get("layer_meta_states").and_then(|m| serde_json::from_str::<Value>(m).ok()).and_then(|v| v.as_array().cloned()).unwrap_or_default();
    // The block's end: every V4 layer's window offset; the plan's geometry from there.
    let mut end = None;
    let mut windows = Vec::with_capacity(spec.geometry.layers.len());
    for (i, l) in spec.geometry.layers.iter().enumerate() {
        let (rows, offset) = window_of(i, l, tensors, &metas)?;
        if let LayerShape::Windowed { ratio, sliding_window, .. } = l {
            if offset == 0 || offset % b != 0 || *end.get_or_insert(offset) != offset {
                return Err(corrupt(format!("layer {i}: window offset {offset} is not the block's end on the {b}-token grid")));
            }
            let (lo, hi) = spec.geometry.window_rows_range(*ratio, *sliding_window, offset);
            if rows < lo || rows > hi {
                return Err(corrupt(format!("layer {i}: window holds {rows} rows, a block ending at {offset} holds {}", if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") })));
            }
        }
        windows.push(rows);
    }
    let end = end.unwrap_or(b);
    // Views of the expected shapes over one zeroed buffer (never read: only shapes matter).
    let mut need = 0usize;
    let shapes = expected_views(spec, end, &windows);
    for v in &shapes {
        for (rows, width) in v.iter() {
            need = need.max(rows * width);
        }
    }
    let zeros = vec![0u16; need];
    let zeros: &[bf16] = half::slice::HalfBitsSliceExt::reinterpret_cast(zeros.as_slice());
    let views = build_views(spec, end, &shapes, zeros);
    let want = contents(spec.geometry.format, model_name, hash, b, &views, 0.0).map_err(|e| corrupt(format!("cannot lay out the plan's block: {e}")))?;
    let named: HashSet<&str> = want.tensors.iter().map(|t| t.name.as_str()).collect();
    if let Some(extra) = tensors.keys().find(|k| !named.contains(k.as_str())) {
        return Err(corrupt(format!("tensor {extra} is not part of a block of this model")));
    }
    for t in &want.tensors {
        let got = tensors.get(&t.name).ok_or_else(|| corrupt(format!("tensor {} is missing", t.name)))?;
        let dtype = match t.dtype {
            "BF16" => Dtype::BF16,
            "F32" => Dtype::F32,
            _ => Dtype::I64,
        };
        if got.dtype != dtype || got.shape != t.shape {
            return Err(corrupt(format!("tensor {} is {:?} {:?}, this model's block has {:?} {:?}", t.name, got.dtype, got.shape, dtype, t.shape)));
        }
        if let TensorData::I64Pair(range) = t.data {
            let mut bytes = [0u8; 16];
            file.read_exact_at(&mut bytes, 8 + header_len + got.data_offsets.0 as u64).map_err(|e| corrupt(format!("tensor {}: {e}", t.name)))?;
            let got = [i64::from_le_bytes(bytes[..8].try_into().unwrap_or_default()), i64::from_le_bytes(bytes[8..].try_into().unwrap_or_default())];
            if got != range {
                return Err(corrupt(format!("tensor {} holds pool rows {got:?}, the block's are {range:?}", t.name)));
            }
        }
    }
    for (k, v) in &want.metadata {
        if k == "created_at" {
            continue;
        }
        match meta.get(k) {
            Some(got) if got == v => {}
            Some(got) => return Err(corrupt(format!("metadata {k} is {got:?}, this model's block has {v:?}"))),
            None => return Err(corrupt(format!("metadata has no {k}"))),
        }
    }
    Ok(())
}

/// Per layer, the `(rows, width)` of every array a block view holds, in [`build_views`] order.
fn expected_views(spec: &StoreSpec, end: usize, windows: &[usize]) -> Vec<Vec<(usize, usize)>> {
    let g = &spec.geometry;
    let b = g.block_size;
    g.layers
        .iter()
        .zip(windows)
        .map(|(l, &rows)| match l {
            LayerShape::Kv { keys, values } => vec![(b, *keys), (b, *values)],
            LayerShape::Windowed { ratio, head_dim, pool_heads, .. } => {
                let mut v = vec![(rows, *head_dim)];
                for &ph in pool_heads {
                    let p = g.pool(*ratio, ph, end);
                    let pooled = match g.format.pool_layout() {
                        PoolLayout::Full => p.pooled,
                        PoolLayout::Delta => p.pooled - p.first,
                    };
                    v.extend([(p.rem, p.out), (p.rem, p.out), (pooled, ph), (p.prev, p.out), (p.prev, p.out)]);
                }
                v
            }
        })
        .collect()
}

fn build_views<'a>(spec: &StoreSpec, end: usize, shapes: &[Vec<(usize, usize)>], zeros: &'a [bf16]) -> Vec<LayerView<'a>> {
    let g = &spec.geometry;
    let view = |&(rows, width): &(usize, usize)| ArrayView { rows, width, data: &zeros[..rows * width] };
    g.layers
        .iter()
        .zip(shapes)
        .map(|(l, s)| match l {
            LayerShape::Kv { .. } => LayerView::Kv(view(&s[0]), view(&s[1])),
            LayerShape::Windowed { ratio, sliding_window, .. } => {
                let (mut pools, mut pool_first, mut prev) = (Vec::new(), Vec::new(), Vec::new());
                for p in s[1..].chunks_exact(5) {
                    pools.push([view(&p[0]), view(&p[1]), view(&p[2])]);
                    pool_first.push(match g.format.pool_layout() {
                        PoolLayout::Full => 0,
                        PoolLayout::Delta => pooled_range(*ratio, g.block_size, end).0,
                    });
                    prev.push((p[3].0 > 0).then(|| [view(&p[3]), view(&p[4])]));
                }
                LayerView::V4(V4BlockView { offset: end, sliding_window: *sliding_window, ratio: *ratio, window: view(&s[0]), pools, pool_first, prev })
            }
        })
        .collect()
}

/// Move a bad file off a block's name into the cache's [`QUARANTINE_DIR`] (a rename: symbolic
/// links and FIFOs are moved, never followed or opened), so the correct block can be written
/// there. Returns where it went.
pub fn move_aside(path: &Path, cache_dir: &Path, why: &Rejection) -> std::io::Result<PathBuf> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = cache_dir.join(QUARANTINE_DIR);
    std::fs::create_dir_all(&dir)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("block");
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
    let to = dir.join(format!("{name}.{ms}.{}.{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)));
    std::fs::rename(path, &to)?;
    tracing::warn!(file = %path.display(), moved_to = %to.display(), reason = %why, "moved a bad file off a block's name");
    Ok(to)
}

/// Upstream's compatibility identity: `block_size`, `payload_layout` and a `cache_signature`
/// that agrees with the block's own metadata (what oMLX's startup scan compares against the
/// loaded model; a block failing it would be swept as incompatible).
fn check_signature<'m>(get: &dyn Fn(&str) -> Result<&'m str, String>, layout: &str, model_name: &str, num_layers: usize, token_count: usize, types: &Value) -> Result<(), String> {
    let block_size: usize = get("block_size")?.parse().map_err(|_| "metadata block_size is not an integer".to_string())?;
    if block_size != token_count {
        return Err(format!("metadata block_size {block_size} but the block holds {token_count} tokens"));
    }
    let stated = get("payload_layout")?;
    if stated != layout {
        return Err(format!("payload layout {stated:?}, this oMLX reads {layout:?}"));
    }
    let sig: Value = serde_json::from_str(get("cache_signature")?).map_err(|e| format!("cache_signature is not JSON: {e}"))?;
    let field = |k: &str| sig.get(k).ok_or_else(|| format!("cache_signature has no {k}"));
    let mismatch = |k: &str, v: &Value, want: &dyn std::fmt::Display| format!("cache_signature {k} {v} does not match the block's {want}");
    let v = field("model_name")?;
    if v.as_str() != Some(model_name) {
        return Err(mismatch("model_name", v, &format!("{model_name:?}")));
    }
    let v = field("num_layers")?;
    if v.as_u64() != Some(num_layers as u64) {
        return Err(mismatch("num_layers", v, &num_layers));
    }
    let v = field("block_size")?;
    if v.as_u64() != Some(block_size as u64) {
        return Err(mismatch("block_size", v, &block_size));
    }
    let v = field("layer_cache_types")?;
    if v != types {
        return Err(mismatch("layer_cache_types", v, types));
    }
    let v = field("payload_layout")?;
    if v.as_str() != Some(layout) {
        return Err(mismatch("payload_layout", v, &layout));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::file::{write_atomic, Tensor};

    fn block(dir: &Path, hash: &str, meta_edit: impl Fn(&mut Vec<(String, String)>)) -> std::path::PathBuf {
        let path = dir.join(&hash[..1]).join(format!("{hash}.safetensors"));
        let mut meta: Vec<(String, String)> = [
            ("omlx_cache_format_version", "3"),
            ("block_hash", hash),
            ("token_count", "4"),
            ("num_layers", "1"),
            ("model_name", "/m"),
            ("created_at", "1.0"),
            ("layer_cache_types", "[\"KVCache\"]"),
            ("layer_meta_states", "[[]]"),
            ("layer_0_state_count", "2"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        meta_edit(&mut meta);
        let t = vec![Tensor::zero_f32("layer_0_state_0".into()), Tensor::zero_f32("layer_0_state_1".into())];
        write_atomic(&path, &t, &meta).unwrap();
        path
    }

    #[test]
    fn accepts_good_and_names_each_rejection() {
        let dir = std::env::temp_dir().join(format!("pd-bridge-validate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let h = "a".repeat(64);
        let good = block(&dir, &h, |_| {});
        let info = inspect(&good, &Expect { model_name: Some("/m".into()), num_layers: Some(1), block_size: Some(4), ..Default::default() }).unwrap();
        assert_eq!(info.token_count, 4);

        let set = |k: &'static str, v: &'static str| move |m: &mut Vec<(String, String)>| m.iter_mut().filter(|e| e.0 == k).for_each(|e| e.1 = v.into());
        let cases: Vec<(String, String)> = vec![
            (block(&dir, &"b".repeat(64), set("omlx_cache_format_version", "1")).display().to_string(), "format version".into()),
            (block(&dir, &"c".repeat(64), set("block_hash", "dd")).display().to_string(), "does not match the file name".into()),
            (block(&dir, &"e".repeat(64), set("layer_0_state_count", "3")).display().to_string(), "layer_0_state_2 is missing".into()),
            (block(&dir, &"f".repeat(64), set("model_name", "/other")).display().to_string(), "belongs to model".into()),
        ];
        let expect = Expect { model_name: Some("/m".into()), ..Default::default() };
        for (p, why) in cases {
            let e = inspect(Path::new(&p), &expect).unwrap_err().reason;
            assert!(e.contains(&why), "{p}: {e}");
        }
        let bytes = std::fs::read(&good).unwrap();
        std::fs::write(&good, &bytes[..bytes.len() - 3]).unwrap();
        assert!(inspect(&good, &expect).unwrap_err().reason.contains("not a valid safetensors"));
        let tmp = dir.join("a").join("x_tmp.safetensors");
        std::fs::write(&tmp, b"junk").unwrap();
        assert!(inspect(&tmp, &expect).unwrap_err().reason.contains("64-hex-digit"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
