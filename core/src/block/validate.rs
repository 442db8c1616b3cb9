//! The block validator: what must hold before oMLX may index (and so serve) a block file.
//!
//! It checks the file name, the safetensors framing (a truncated or garbled file fails here),
//! the format version oMLX reads, that the file's `block_hash` is its name, the counts and
//! per-layer tensors that oMLX's reconstruction will look up, and — when the caller knows
//! them — the model, layer count and block size. Every rejection says why.

use std::collections::HashSet;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;
use safetensors::SafeTensors;
use serde_json::Value;

use super::chain::ChainHash;
use crate::format::OmlxFormat;

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

/// Validate one block file; `Err` carries the reason it must not be served.
pub fn inspect(path: &Path, expect: &Expect) -> Result<BlockInfo, String> {
    let name = path.file_name().and_then(|n| n.to_str()).ok_or("file name is not UTF-8")?;
    let stem = name.strip_suffix(".safetensors").ok_or_else(|| format!("{name:?} is not a .safetensors block file"))?;
    let hash = ChainHash::from_hex(stem).filter(|_| stem.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    let hash = hash.ok_or_else(|| format!("{name:?} is not named by a 64-hex-digit block hash"))?;
    if let Some(dir) = path.parent().and_then(|d| d.file_name()).and_then(|d| d.to_str()) {
        if dir != &stem[..1] {
            return Err(format!("lies in directory {dir:?}, not {:?}", &stem[..1]));
        }
    }
    let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let file_size = file.metadata().map_err(|e| format!("cannot stat: {e}"))?.len();
    if file_size < 8 {
        return Err(format!("truncated: {file_size} bytes"));
    }
    // SAFETY: blocks are immutable once named (writers rename complete files into place).
    let map = unsafe { Mmap::map(&file) }.map_err(|e| format!("cannot map: {e}"))?;
    let st = SafeTensors::deserialize(&map).map_err(|e| format!("not a valid safetensors file: {e}"))?;
    let (_, header) = SafeTensors::read_metadata(&map).map_err(|e| format!("not a valid safetensors file: {e}"))?;
    let meta = header.metadata().as_ref().ok_or("has no __metadata__")?;
    let get = |k: &str| meta.get(k).map(String::as_str).ok_or_else(|| format!("metadata has no {k}"));

    let version = get("omlx_cache_format_version")?;
    let readable = expect.format.readable_versions();
    if !readable.contains(&version) {
        return Err(format!("format version {version:?} is not supported by {} (readable: {readable:?})", expect.format));
    }
    let stated = get("block_hash")?;
    if stated != stem {
        return Err(format!("metadata block_hash {stated} does not match the file name"));
    }
    let number = |k: &str| -> Result<usize, String> { get(k)?.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| format!("metadata {k} is not a positive integer")) };
    let token_count = number("token_count")?;
    let num_layers = number("num_layers")?;
    let model_name = get("model_name")?.to_string();
    if let Some(m) = &expect.model_name {
        if &model_name != m {
            return Err(format!("belongs to model {model_name:?}, not {m:?}"));
        }
    }
    if let Some(n) = expect.num_layers {
        if num_layers != n {
            return Err(format!("has {num_layers} layers, the model has {n}"));
        }
    }
    if let Some(b) = expect.block_size {
        if token_count != b {
            return Err(format!("holds {token_count} tokens, the block size is {b}"));
        }
    }

    let types: Value = serde_json::from_str(get("layer_cache_types")?).map_err(|e| format!("layer_cache_types is not JSON: {e}"))?;
    if let Some(layout) = expect.format.payload_layout() {
        check_signature(&get, layout, &model_name, num_layers, token_count, &types)?;
    }

    // Every tensor oMLX's reconstruction will ask for must be there.
    let types = types.as_array().ok_or("layer_cache_types is not a list")?;
    if types.len() != num_layers {
        return Err(format!("layer_cache_types lists {} layers, num_layers says {num_layers}", types.len()));
    }
    let names: HashSet<&str> = st.names().into_iter().collect();
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
    Ok(BlockInfo { hash, token_count, num_layers, model_name, file_size })
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
            let e = inspect(Path::new(&p), &expect).unwrap_err();
            assert!(e.contains(&why), "{p}: {e}");
        }
        let bytes = std::fs::read(&good).unwrap();
        std::fs::write(&good, &bytes[..bytes.len() - 3]).unwrap();
        assert!(inspect(&good, &expect).unwrap_err().contains("not a valid safetensors"));
        let tmp = dir.join("a").join("x_tmp.safetensors");
        std::fs::write(&tmp, b"junk").unwrap();
        assert!(inspect(&tmp, &expect).unwrap_err().contains("64-hex-digit"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
