//! The store's structured fuzzer, shared by `tests/fuzz_store.rs` (a bounded run inside `cargo
//! test`) and `examples/fuzz_store.rs` (a long run that prints cases per second and findings).
//!
//! Each case takes a valid input — a segment payload a capture produced, a block file the writer
//! wrote from it, a decoder `config.json` — and applies a few structured mutations: JSON nodes of
//! the header replaced (numbers at the edges, wrong types, empty containers), deleted, duplicated
//! or nudged, JSON inside block metadata strings mutated the same way, array values set to NaN,
//! infinity or extremes, bytes flipped, the length prefix or the size changed, and the body
//! resized to what the mutated header declares (so the deeper checks run, not only the framing).
//! The target must not panic, every rejection must be the typed one, and what is accepted must
//! hold up: an admitted segment has only finite values on its block, an accepted block parses as
//! safetensors, an accepted config gives a usable plan.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::bf16;
use pd_bridge_core::block::spec::{first_not_finite, StoreSpec};
use pd_bridge_core::block::validate::{inspect_with, Expect};
use pd_bridge_core::block::BlockWriter;
use pd_bridge_core::capture::Capture;
use pd_bridge_core::segment::Segment;
use pd_bridge_core::{CoreError, DecoderWeights, ModelPlan, OmlxFormat};
use proptest::prelude::*;
use serde_json::Value;

use crate::common::{mla_model_dir, random_rows, temp_dir, v4_model_dir, Rng};

/// A replacement JSON value.
#[derive(Clone, Debug)]
pub enum Atom {
    Int(i64),
    Big(u64),
    Float(f64),
    Str(String),
    Bool(bool),
    Null,
    List,
    Object,
}

impl Atom {
    fn value(&self) -> Value {
        match self {
            Atom::Int(i) => Value::from(*i),
            Atom::Big(u) => Value::from(*u),
            Atom::Float(f) => serde_json::Number::from_f64(*f).map(Value::Number).unwrap_or(Value::Null),
            Atom::Str(s) => Value::from(s.clone()),
            Atom::Bool(b) => Value::from(*b),
            Atom::Null => Value::Null,
            Atom::List => Value::Array(vec![]),
            Atom::Object => Value::Object(Default::default()),
        }
    }
}

/// One structured change to an input.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// Replace the `pick`-th JSON node of the header (pre-order, modulo their count).
    Replace { pick: usize, atom: Atom },
    /// Delete the `pick`-th node from its parent.
    Delete { pick: usize },
    /// Append a copy of an array node's first element (or the node itself to its parent list).
    Duplicate { pick: usize },
    /// Add `delta` to the `pick`-th number.
    Nudge { pick: usize, delta: i64 },
    /// Inside a block's metadata string that holds JSON (layer_meta_states, cache_signature...).
    Inner { key: usize, pick: usize, atom: Atom },
    /// Set body bf16 value `at` (modulo) to a special value (0 NaN, 1 +inf, 2 -inf, 3 max, 4 -0).
    Special { at: usize, kind: u8 },
    /// XOR a body byte.
    Flip { at: usize, mask: u8 },
    /// Keep `permille`/1000 of the bytes.
    Truncate { permille: u16 },
    /// Append bytes.
    Extend { n: u16 },
    /// Change the header length prefix.
    Prefix { delta: i8 },
    /// Resize the body to what the (mutated) header declares.
    Fit,
}

fn atom() -> impl Strategy<Value = Atom> {
    prop_oneof![
        prop_oneof![Just(0i64), Just(-1), Just(1), Just(2), Just(7), Just(i64::MIN), Just(1 << 31), Just(1 << 32), -300i64..300].prop_map(Atom::Int),
        prop_oneof![Just(u64::MAX), Just(1u64 << 53), Just(u32::MAX as u64 + 1)].prop_map(Atom::Big),
        prop_oneof![Just(0.5f64), Just(-0.0), Just(1e308), Just(-1e-300), Just(3.0)].prop_map(Atom::Float),
        prop_oneof![Just(String::new()), Just("kv".to_string()), Just("v4".to_string()), Just("CacheList".to_string()), Just("BF16".to_string()), Just("F32".to_string()), Just("I64".to_string()), Just("[]".to_string()), Just("{}".to_string()), "[a-z0-9_]{1,8}"].prop_map(Atom::Str),
        any::<bool>().prop_map(Atom::Bool),
        Just(Atom::Null),
        Just(Atom::List),
        Just(Atom::Object),
    ]
}

pub fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), atom()).prop_map(|(pick, atom)| Mutation::Replace { pick, atom }),
        2 => any::<usize>().prop_map(|pick| Mutation::Delete { pick }),
        1 => any::<usize>().prop_map(|pick| Mutation::Duplicate { pick }),
        4 => (any::<usize>(), prop_oneof![Just(1i64), Just(-1), Just(2), Just(-2), Just(4), Just(64), Just(-64), Just(1 << 20)]).prop_map(|(pick, delta)| Mutation::Nudge { pick, delta }),
        3 => (any::<usize>(), any::<usize>(), atom()).prop_map(|(key, pick, atom)| Mutation::Inner { key, pick, atom }),
        3 => (any::<usize>(), 0u8..5).prop_map(|(at, kind)| Mutation::Special { at, kind }),
        2 => (any::<usize>(), 1u8..=255).prop_map(|(at, mask)| Mutation::Flip { at, mask }),
        1 => (0u16..1000).prop_map(|permille| Mutation::Truncate { permille }),
        1 => (1u16..64).prop_map(|n| Mutation::Extend { n }),
        1 => any::<i8>().prop_map(|delta| Mutation::Prefix { delta }),
        3 => Just(Mutation::Fit),
    ]
}

/// A case: which seed input, and the mutations applied to it in order.
pub fn case() -> impl Strategy<Value = (usize, Vec<Mutation>)> {
    (any::<usize>(), prop::collection::vec(mutation(), 1..5))
}

/// The valid inputs the cases start from.
pub struct Seeds {
    pub streams: Vec<SeedStream>,
    pub blocks: Vec<SeedBlock>,
    pub configs: Vec<String>,
    pub scratch: PathBuf,
}

pub struct SeedStream {
    pub format: OmlxFormat,
    pub plan: ModelPlan,
    pub block: usize,
    pub tokens: Vec<u32>,
    pub segments: Vec<Segment>,
    pub payloads: Vec<Vec<u8>>,
}

pub struct SeedBlock {
    pub stream: usize,
    pub index: usize,
    pub bytes: Vec<u8>,
    pub name: String,
    pub sub: String,
}

fn stream(model: PathBuf, format: OmlxFormat, block: usize, blocks: usize) -> SeedStream {
    let w = Arc::new(DecoderWeights::load(&model).expect("seed model"));
    let prompt = block * blocks + 3;
    let hidden = w.plan.hidden_size();
    let mut rng = Rng::new(5);
    let mut cap = Capture::with_format(format, w.clone(), "fuzz", prompt, block).expect("capture");
    let mut segments = Vec::new();
    let mut start = 0;
    while start < prompt {
        let end = (start + 50).min(prompt);
        for l in 0..w.plan.num_layers() {
            cap.feed(l, start, &random_rows(&mut rng, end - start, hidden)).expect("feed");
        }
        segments.extend(cap.take_ready());
        start = end;
    }
    let payloads = segments.iter().map(Segment::encode).collect();
    SeedStream { format, plan: w.plan.clone(), block, tokens: (0..prompt as u32).collect(), segments, payloads }
}

impl Seeds {
    pub fn new() -> Seeds {
        let v4 = v4_model_dir(61);
        let mla = mla_model_dir(62);
        let streams = vec![
            stream(v4.clone(), OmlxFormat::Fork070, 16, 3),
            stream(v4.clone(), OmlxFormat::Upstream063, 16, 3),
            stream(mla.clone(), OmlxFormat::Fork070, 8, 3),
        ];
        let dir = temp_dir("fuzz-seed-blocks");
        let mut blocks = Vec::new();
        for (i, s) in streams.iter().enumerate() {
            let w = BlockWriter::with_format(s.format, dir.join(i.to_string()), "m", s.block, &s.tokens).unwrap().with_plan(&s.plan).unwrap();
            for (k, seg) in s.segments.iter().enumerate() {
                let path = w.write_segment(seg).expect("seed block").path;
                w.flush().unwrap();
                let name = path.file_name().unwrap().to_str().unwrap().to_string();
                let sub = name[..1].to_string();
                blocks.push(SeedBlock { stream: i, index: k, bytes: std::fs::read(&path).unwrap(), name, sub });
            }
        }
        let mut configs: Vec<String> = [v4, mla].iter().map(|d| std::fs::read_to_string(d.join("config.json")).unwrap()).collect();
        configs.push(r#"{"model_type":"deepseek_v4","hidden_size":4096,"num_hidden_layers":4,"head_dim":512,"qk_rope_head_dim":64,"index_head_dim":128,"sliding_window":128,"compress_ratios":[0,4,128,4,0],"rope_theta":10000,"compress_rope_theta":160000,"rms_norm_eps":1e-6,"quantization":{"group_size":64,"bits":4}}"#.into());
        configs.push(r#"{"model_type":"kimi_k2","hidden_size":7168,"num_hidden_layers":61,"kv_lora_rank":512,"qk_rope_head_dim":64,"rope_theta":50000,"rope_scaling":{"type":"yarn","factor":32,"beta_fast":1,"beta_slow":1,"mscale":1.0,"mscale_all_dim":1.0,"original_max_position_embeddings":4096}}"#.into());
        Seeds { streams, blocks, configs, scratch: temp_dir("fuzz-scratch") }
    }
}

// ---- applying mutations -------------------------------------------------------------------

/// Every node of a JSON tree as a path of keys / indices, pre-order (the root first).
fn nodes(v: &Value) -> Vec<Vec<PathStep>> {
    let mut out = vec![vec![]];
    fn walk(v: &Value, at: &mut Vec<PathStep>, out: &mut Vec<Vec<PathStep>>) {
        match v {
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    at.push(PathStep::Index(i));
                    out.push(at.clone());
                    walk(x, at, out);
                    at.pop();
                }
            }
            Value::Object(o) => {
                for (k, x) in o {
                    at.push(PathStep::Key(k.clone()));
                    out.push(at.clone());
                    walk(x, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }
    walk(v, &mut vec![], &mut out);
    out
}

#[derive(Clone, Debug)]
enum PathStep {
    Index(usize),
    Key(String),
}

fn at_mut<'a>(v: &'a mut Value, path: &[PathStep]) -> Option<&'a mut Value> {
    let mut cur = v;
    for s in path {
        cur = match (s, cur) {
            (PathStep::Index(i), Value::Array(a)) => a.get_mut(*i)?,
            (PathStep::Key(k), Value::Object(o)) => o.get_mut(k)?,
            _ => return None,
        };
    }
    Some(cur)
}

/// Apply the JSON mutations to `v`; true if one applied.
fn mutate_json(v: &mut Value, m: &Mutation) -> bool {
    let all = nodes(v);
    match m {
        Mutation::Replace { pick, atom } => {
            let path = &all[pick % all.len()];
            if let Some(n) = at_mut(v, path) {
                *n = atom.value();
            }
            true
        }
        Mutation::Delete { pick } => {
            if all.len() < 2 {
                return false;
            }
            let path = &all[1 + pick % (all.len() - 1)];
            let (last, parent) = path.split_last().unwrap();
            match (at_mut(v, parent), last) {
                (Some(Value::Array(a)), PathStep::Index(i)) if *i < a.len() => {
                    a.remove(*i);
                }
                (Some(Value::Object(o)), PathStep::Key(k)) => {
                    o.remove(k);
                }
                _ => {}
            }
            true
        }
        Mutation::Duplicate { pick } => {
            let path = &all[pick % all.len()];
            if let Some(Value::Array(a)) = at_mut(v, path) {
                if let Some(first) = a.first().cloned() {
                    a.push(first);
                }
            }
            true
        }
        Mutation::Nudge { pick, delta } => {
            let numbers: Vec<_> = all.iter().filter(|p| at_mut(&mut v.clone(), p).is_some_and(|n| n.is_number())).cloned().collect();
            if numbers.is_empty() {
                return false;
            }
            if let Some(n) = at_mut(v, &numbers[pick % numbers.len()]) {
                *n = match n.as_i64() {
                    Some(i) => Value::from(i.saturating_add(*delta)),
                    None => n.as_u64().map(|u| Value::from(u.wrapping_add(*delta as u64))).unwrap_or(Value::from(*delta)),
                };
            }
            true
        }
        _ => false,
    }
}

fn mutate_body(body: &mut Vec<u8>, m: &Mutation) {
    match *m {
        Mutation::Special { at, kind } if body.len() >= 2 => {
            let i = (at % (body.len() / 2)) * 2;
            let v = [bf16::NAN, bf16::INFINITY, bf16::NEG_INFINITY, bf16::MAX, bf16::NEG_ZERO][kind as usize % 5];
            body[i..i + 2].copy_from_slice(&v.to_le_bytes());
        }
        Mutation::Flip { at, mask } if !body.is_empty() => {
            let i = at % body.len();
            body[i] ^= mask;
        }
        _ => {}
    }
}

fn fit(body: &mut Vec<u8>, want: usize) {
    const CAP: usize = 8 << 20;
    let want = want.min(CAP);
    if body.len() > want {
        body.truncate(want);
    } else {
        // Finite values (1.0) so the deeper checks, not the NaN scan, decide.
        while body.len() < want {
            body.extend_from_slice(&bf16::ONE.to_le_bytes());
        }
        body.truncate(want);
    }
}

/// A segment payload with `muts` applied (header JSON structurally, body values and bytes).
pub fn mutate_segment(payload: &[u8], muts: &[Mutation]) -> Vec<u8> {
    let n = u32::from_le_bytes(payload[..4].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&payload[4..4 + n]).unwrap();
    let mut body = payload[4 + n..].to_vec();
    let mut prefix_delta = 0i64;
    let (mut cut, mut extend) = (None, 0usize);
    for m in muts {
        if mutate_json(&mut header, m) {
            continue;
        }
        match m {
            Mutation::Fit => {
                let declared: u64 = header
                    .get("layers")
                    .and_then(Value::as_array)
                    .map(|ls| {
                        ls.iter()
                            .flat_map(|l| l.get("arrays").and_then(Value::as_array).cloned().unwrap_or_default())
                            .map(|a| a.get("rows").and_then(Value::as_u64).unwrap_or(0).saturating_mul(a.get("width").and_then(Value::as_u64).unwrap_or(0)).saturating_mul(2))
                            .fold(0u64, u64::saturating_add)
                    })
                    .unwrap_or(0);
                fit(&mut body, declared.min(usize::MAX as u64) as usize);
            }
            Mutation::Prefix { delta } => prefix_delta += *delta as i64,
            Mutation::Truncate { permille } => cut = Some(*permille),
            Mutation::Extend { n } => extend += *n as usize,
            other => mutate_body(&mut body, other),
        }
    }
    let head = serde_json::to_vec(&header).unwrap();
    let len = (head.len() as i64 + prefix_delta).clamp(0, u32::MAX as i64) as u32;
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    out.extend_from_slice(&body);
    out.extend(std::iter::repeat_n(0x3f, extend));
    if let Some(p) = cut {
        out.truncate(out.len() * p as usize / 1000);
    }
    out
}

/// A block file with `muts` applied: the safetensors header JSON, JSON inside metadata strings,
/// tensor bytes.
pub fn mutate_block(bytes: &[u8], muts: &[Mutation]) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut body = bytes[8 + n..].to_vec();
    let mut prefix_delta = 0i64;
    let (mut cut, mut extend) = (None, 0usize);
    for m in muts {
        if let Mutation::Inner { key, pick, atom } = m {
            if let Some(Value::Object(meta)) = header.get_mut("__metadata__") {
                let keys: Vec<String> = meta.iter().filter(|(_, v)| v.as_str().is_some_and(|s| s.starts_with('[') || s.starts_with('{'))).map(|(k, _)| k.clone()).collect();
                if let Some(k) = keys.get(key % keys.len().max(1)) {
                    let mut inner: Value = serde_json::from_str(meta[k].as_str().unwrap()).unwrap_or(Value::Null);
                    mutate_json(&mut inner, &Mutation::Replace { pick: *pick, atom: atom.clone() });
                    meta.insert(k.clone(), Value::from(inner.to_string()));
                }
            }
            continue;
        }
        if mutate_json(&mut header, m) {
            continue;
        }
        match m {
            Mutation::Fit => {
                let end = header.as_object().map(|o| o.values().filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64()).max().unwrap_or(0)).unwrap_or(0);
                fit(&mut body, end.min(usize::MAX as u64) as usize);
            }
            Mutation::Prefix { delta } => prefix_delta += *delta as i64,
            Mutation::Truncate { permille } => cut = Some(*permille),
            Mutation::Extend { n } => extend += *n as usize,
            other => mutate_body(&mut body, other),
        }
    }
    let mut head = serde_json::to_vec(&header).unwrap();
    head.resize(head.len().div_ceil(8) * 8, b' ');
    let len = (head.len() as i64 + prefix_delta).max(0) as u64;
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(&head);
    out.extend_from_slice(&body);
    out.extend(std::iter::repeat_n(0u8, extend));
    if let Some(p) = cut {
        out.truncate(out.len() * p as usize / 1000);
    }
    out
}

// ---- running cases ------------------------------------------------------------------------

/// How a case ended: accepted, or rejected with the (typed) error's kind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Accepted,
    Rejected(&'static str),
}

fn kind(e: &CoreError) -> &'static str {
    match e {
        CoreError::Segment { .. } => "segment",
        CoreError::Wire(_) => "wire",
        CoreError::Input { .. } => "input",
        CoreError::Config { .. } => "config",
        CoreError::Io { .. } => "io",
        _ => "other",
    }
}

/// Decode a mutated segment and offer it to a writer (with the decoder's plan, or without)
/// positioned where the seed segment's stream stood; `write`: also write it (and the blocks
/// before it) into `dir`. `Err` is a finding.
pub fn segment_case(seeds: &Seeds, pick: usize, muts: &[Mutation], write: bool, dir: &Path) -> Result<Outcome, String> {
    let s = &seeds.streams[pick % seeds.streams.len()];
    let k = (pick / seeds.streams.len()) % s.segments.len();
    let bytes = mutate_segment(&s.payloads[k], muts);
    let seg = match Segment::decode(&bytes) {
        Ok(seg) => seg,
        Err(CoreError::Wire(_)) => return Ok(Outcome::Rejected("wire")),
        Err(e) => return Err(format!("decode: untyped rejection {e:?}")),
    };
    let _ = seg.views();
    let mut w = BlockWriter::with_format(s.format, dir, "m", s.block, &s.tokens).map_err(|e| e.to_string())?;
    if pick % 5 != 0 {
        w = w.with_plan(&s.plan).map_err(|e| e.to_string())?;
    }
    for before in &s.segments[..k] {
        let r = if write { w.write_segment(before).map(|_| ()) } else { w.check_segment(before) };
        r.map_err(|e| format!("a seed segment was refused: {e}"))?;
    }
    let got = if write { w.write_segment(&seg).map(|_| ()).and_then(|_| w.flush()) } else { w.check_segment(&seg) };
    match got {
        Ok(()) => {
            if let Some((i, v)) = seg.arrays.iter().find_map(|a| first_not_finite(a)) {
                return Err(format!("admitted a segment holding {v} at value {i}"));
            }
            let b = s.block as u64;
            if (seg.header.start, seg.header.end) != (seg.header.index as u64 * b, (seg.header.index as u64 + 1) * b) {
                return Err(format!("admitted a segment off the block grid: {:?}", (seg.header.index, seg.header.start, seg.header.end)));
            }
            if w.plan().is_some() && seg.header.layers.len() != s.plan.num_layers() {
                return Err("admitted a segment with the wrong layer count".into());
            }
            Ok(Outcome::Accepted)
        }
        Err(e @ (CoreError::Segment { .. } | CoreError::Wire(_) | CoreError::Input { .. })) => Ok(Outcome::Rejected(kind(&e))),
        Err(e) => Err(format!("writer: untyped rejection {e:?}")),
    }
}

/// Validate a mutated block file (on its own name, in a cache directory) against the plan.
pub fn block_case(seeds: &Seeds, pick: usize, muts: &[Mutation], dir: &Path) -> Result<Outcome, String> {
    let b = &seeds.blocks[pick % seeds.blocks.len()];
    let s = &seeds.streams[b.stream];
    let bytes = mutate_block(&b.bytes, muts);
    let path = dir.join(&b.sub).join(&b.name);
    std::fs::create_dir_all(path.parent().unwrap()).map_err(|e| e.to_string())?;
    std::fs::write(&path, &bytes).map_err(|e| e.to_string())?;
    let expect = Expect { format: s.format, model_name: Some("m".into()), num_layers: Some(s.plan.num_layers()), block_size: Some(s.block) };
    let plan = (pick % 3 != 0).then_some(&s.plan);
    match inspect_with(&path, &expect, plan, Some(dir)) {
        Ok(info) => {
            safetensors::SafeTensors::deserialize(&bytes).map_err(|e| format!("accepted a block safetensors cannot read: {e}"))?;
            if info.token_count != s.block {
                return Err(format!("accepted a block of {} tokens", info.token_count));
            }
            Ok(Outcome::Accepted)
        }
        Err(r) => Ok(Outcome::Rejected(match r.kind {
            pd_bridge_core::block::validate::RejectKind::Name => "name",
            pd_bridge_core::block::validate::RejectKind::NotRegular => "not-regular",
            pd_bridge_core::block::validate::RejectKind::Outside => "outside",
            pd_bridge_core::block::validate::RejectKind::Corrupt => "corrupt",
            pd_bridge_core::block::validate::RejectKind::Foreign => "foreign",
            pd_bridge_core::block::validate::RejectKind::Unreadable => "unreadable",
        })),
    }
}

/// Parse a mutated config.json; an accepted one must give a plan the store can lay out.
pub fn config_case(seeds: &Seeds, pick: usize, muts: &[Mutation]) -> Result<Outcome, String> {
    let text = &seeds.configs[pick % seeds.configs.len()];
    let mut v: Value = serde_json::from_str(text).unwrap();
    let mut raw = None;
    for m in muts {
        if !mutate_json(&mut v, m) {
            if let Mutation::Flip { at, mask } = m {
                let mut b = v.to_string().into_bytes();
                let i = at % b.len();
                b[i] ^= mask;
                raw = Some(String::from_utf8_lossy(&b).into_owned());
            }
        }
    }
    let text = raw.unwrap_or_else(|| v.to_string());
    match ModelPlan::from_config_json(&text) {
        Ok(plan) => {
            for f in OmlxFormat::ALL {
                let b = f.block_size(&plan);
                if b == 0 {
                    return Err(format!("{f}: block size 0"));
                }
                StoreSpec::new(&plan, f, b).map_err(|e| format!("accepted a plan the store cannot lay out: {e}"))?;
            }
            if let ModelPlan::DeepseekV4(p) = &plan {
                if p.compress_ratios.len() != p.num_layers {
                    return Err("compress_ratios disagree with the layer count".into());
                }
            }
            Ok(Outcome::Accepted)
        }
        Err(CoreError::Config { .. }) => Ok(Outcome::Rejected("config")),
        Err(e) => Err(format!("untyped rejection {e:?}")),
    }
}
