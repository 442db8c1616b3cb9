//! The carry state: everything the decoder's cache math needs to continue a request from a block
//! boundary `S` instead of from token 0 (issue 13, multi-turn), next to the pooler it continues.
//!
//! Per DeepSeek-V4 layer that is the rotating window's rows (the decoder's own rows: the last
//! `sliding_window`, or the fork's raw rotating buffer of a compressed layer), and per compressor
//! its remainder rows (`buf_kv`, `buf_gate`), the previous ratio-4 window where the decoder carries
//! it (upstream) and how many pooled rows exist before `S` (so later pool deltas start at the
//! right row). Pooled rows themselves are not carried: the decoder already holds them and every
//! later pooled row depends only on rows from `S` on, the remainder and the previous window. MLA
//! carries nothing beyond the position: a token's latent depends on that token alone.
//!
//! The decode host holds the block ending at `S` and is the source of truth: it extracts the
//! carry state from that block file (`CarryState::from_block_file`, in [`crate::block::read`])
//! and sends it to the prefill host, which resumes its capture from it
//! ([`crate::capture::Capture::resume`]). The state names the weights fingerprint, the oMLX block
//! format, the block size, `S` and the block's chain hash; a capture refuses a carry state that
//! disagrees with any of them ([`CarryField`] says which).
//!
//! Bytes ([`CarryState::encode`]): `"PDCS" | version u32 LE | header length u32 LE | header JSON |
//! arrays as LE bf16 in header order | crc32 u32 LE of everything before it`.

use half::bf16;
use serde::{Deserialize, Serialize};

use crate::block::chain::ChainHash;
use crate::error::{CarryField, CoreError, Result};
use crate::format::OmlxFormat;
use crate::geometry::{Geometry, LayerShape};

/// Version of the carry-state bytes this build writes and reads.
pub const CARRY_VERSION: u32 = 1;
const MAGIC: &[u8; 4] = b"PDCS";

pub(crate) fn err(what: CarryField, reason: impl Into<String>) -> CoreError {
    CoreError::Carry { what, reason: reason.into() }
}

/// Framed carry bytes, every family's: `magic | version u32 LE | header length u32 LE | header |
/// the body (`body_len` bytes, written by `body`) | crc32 u32 LE of everything before it`.
pub(crate) fn frame(magic: &[u8; 4], version: u32, head: &[u8], body_len: usize, body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + head.len() + body_len + 4);
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(head.len() as u32).to_le_bytes());
    out.extend_from_slice(head);
    body(&mut out);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The header and the body of [`frame`]d bytes, after checking the magic, the version and the
/// checksum (`what`: whose bytes, for the message: "carry state", ...).
pub(crate) fn unframe<'a>(bytes: &'a [u8], magic: &[u8; 4], version: u32, what: &str) -> Result<(&'a [u8], &'a [u8])> {
    let framing = |r: String| err(CarryField::Framing, r);
    if bytes.len() < 16 || &bytes[..4] != magic {
        return Err(framing(format!("not a pd-bridge {what} (bad magic or too short)")));
    }
    let found = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
    if found != version {
        return Err(framing(format!("version {found}; this build reads version {version}")));
    }
    let (payload, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(payload).to_le_bytes() != crc {
        return Err(framing("checksum mismatch: the bytes were damaged".into()));
    }
    let n = u32::from_le_bytes(payload[8..12].try_into().expect("4 bytes")) as usize;
    let head = payload.get(12..12 + n).ok_or_else(|| framing(format!("header of {n} bytes overruns the payload")))?;
    Ok((head, &payload[12 + n..]))
}

/// One compressor's carry (the layer's pool, or the indexer's).
#[derive(Clone, Debug, PartialEq)]
pub struct PoolCarry {
    /// Width of a raw row (`2·head_dim` for ratio 4, `head_dim` for ratio 128).
    pub width: usize,
    /// Pooled rows before `S` (`S / ratio`): where the next delta starts.
    pub pooled_rows: usize,
    /// Raw rows of the incomplete window, `[S % ratio, width]` each.
    pub buf_kv: Vec<bf16>,
    pub buf_gate: Vec<bf16>,
    /// The previous complete ratio-4 window `[kv, gate]` (`[ratio, width]` each) where the
    /// decoder carries it across forward calls (upstream); None otherwise.
    pub prev: Option<[Vec<bf16>; 2]>,
}

/// One DeepSeek-V4 layer's carry.
#[derive(Clone, Debug, PartialEq)]
pub struct V4Carry {
    pub sliding_window: usize,
    /// 0 for a window-only layer (then `pools` is empty).
    pub ratio: usize,
    pub head_dim: usize,
    /// The window rows the block holds, `[rows, head_dim]`, oldest first.
    pub window: Vec<bf16>,
    /// Compressor, then indexer.
    pub pools: Vec<PoolCarry>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum LayerCarry {
    V4(V4Carry),
    /// A plain KV layer (MLA): each block holds its own slice, nothing crosses the boundary.
    Kv,
}

/// The decoder's carry state at block boundary `position` for every layer.
#[derive(Clone, Debug, PartialEq)]
pub struct CarryState {
    pub format: OmlxFormat,
    pub fingerprint: String,
    pub block_size: usize,
    /// `S`: tokens before the boundary (a positive multiple of `block_size`).
    pub position: usize,
    /// Key of the block ending at `S` (the prefix's chain hash), when known.
    pub chain_hash: Option<ChainHash>,
    pub layers: Vec<LayerCarry>,
}

impl CarryState {
    /// Refuse the carry state unless it was made for these weights and for `geometry`'s format
    /// and block size, and fits its layers at its position.
    pub fn check_for(&self, fingerprint: &str, geometry: &Geometry) -> Result<()> {
        let (format, block_size) = (geometry.format, geometry.block_size);
        if self.fingerprint != fingerprint {
            return Err(err(CarryField::Fingerprint, format!("made from weights {}, this capture's are {fingerprint}", self.fingerprint)));
        }
        if self.format != format {
            return Err(err(CarryField::Format, format!("made for oMLX block format {:?}, this capture is for {:?}", self.format.name(), format.name())));
        }
        if self.block_size != block_size {
            return Err(err(CarryField::BlockSize, format!("made for {}-token blocks, this capture's are {block_size}", self.block_size)));
        }
        self.check(geometry)
    }

    /// The carry state is whole and fits the decoder's layers at its own position, as `geometry`
    /// (for the carry state's own format and block size) gives them.
    pub fn check(&self, geometry: &Geometry) -> Result<()> {
        let (s, b) = (self.position, self.block_size);
        if geometry.format != self.format || geometry.block_size != b {
            return Err(err(CarryField::Format, format!("checked against the blocks of {} with {} tokens, it was made for {} with {b}", geometry.format, geometry.block_size, self.format)));
        }
        if b == 0 || s == 0 || s % b != 0 {
            return Err(err(CarryField::Position, format!("position {s} is not a positive multiple of the block size {b}")));
        }
        if self.layers.len() != geometry.layers.len() {
            return Err(err(CarryField::Plan, format!("{} layers, the model has {}", self.layers.len(), geometry.layers.len())));
        }
        for (i, (got, want)) in self.layers.iter().zip(&geometry.layers).enumerate() {
            match (got, want) {
                (LayerCarry::Kv, LayerShape::Kv { .. }) => {}
                (LayerCarry::V4(c), &LayerShape::Windowed { sliding_window, ratio, head_dim, ref pool_heads }) => {
                    if (c.sliding_window, c.ratio, c.head_dim, c.pools.len()) != (sliding_window, ratio, head_dim, pool_heads.len()) {
                        return Err(err(
                            CarryField::Plan,
                            format!(
                                "layer {i}: window {} ratio {} head_dim {} with {} pools, the model's is window {sliding_window} ratio {ratio} head_dim {head_dim} with {}",
                                c.sliding_window,
                                c.ratio,
                                c.head_dim,
                                c.pools.len(),
                                pool_heads.len()
                            ),
                        ));
                    }
                    let window_rows = geometry.window_rows(ratio, sliding_window, s);
                    if c.window.len() != window_rows * head_dim {
                        return Err(err(CarryField::Position, format!("layer {i}: window of {} values; at token {s} it holds {window_rows} rows of {head_dim}", c.window.len())));
                    }
                    for (j, (p, &head)) in c.pools.iter().zip(pool_heads).enumerate() {
                        let e = geometry.pool(ratio, head, s);
                        if p.width != e.out {
                            return Err(err(CarryField::Plan, format!("layer {i} pool {j}: rows of width {}, the model's are {}", p.width, e.out)));
                        }
                        if p.pooled_rows != e.pooled || p.buf_kv.len() != e.rem * e.out || p.buf_gate.len() != e.rem * e.out {
                            return Err(err(
                                CarryField::Position,
                                format!(
                                    "layer {i} pool {j}: {} pooled rows and remainders of {}/{} values; at token {s} it has {} pooled rows and {} remainder rows of {}",
                                    p.pooled_rows,
                                    p.buf_kv.len(),
                                    p.buf_gate.len(),
                                    e.pooled,
                                    e.rem,
                                    e.out
                                ),
                            ));
                        }
                        match (&p.prev, e.prev > 0) {
                            (None, false) => {}
                            (Some([k, g]), true) if k.len() == e.prev * e.out && g.len() == e.prev * e.out => {}
                            (got, carried) => {
                                let what = got.as_ref().map_or("no previous window".to_string(), |[k, g]| format!("a previous window of {}/{} values", k.len(), g.len()));
                                let want = if carried { format!("the previous window [{ratio}, {}]", e.out) } else { "none".to_string() };
                                return Err(err(CarryField::Position, format!("layer {i} pool {j}: {what}; {} at token {s} carries {want}", self.format)));
                            }
                        }
                    }
                }
                (got, want) => {
                    let kind = |v4: bool| if v4 { "a DeepSeek-V4 layer" } else { "a KV layer" };
                    return Err(err(CarryField::Plan, format!("layer {i}: {} carry, the model has {}", kind(matches!(got, LayerCarry::V4(_))), kind(matches!(want, LayerShape::Windowed { .. })))));
                }
            }
        }
        Ok(())
    }

    /// Per layer, per pool (compressor, then indexer): the pooled rows before the resume point,
    /// where the decode host's continuity checks of a resumed stream start (KV layers: none).
    pub fn pool_rows(&self) -> Vec<Vec<u64>> {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCarry::V4(c) => c.pools.iter().map(|p| p.pooled_rows as u64).collect(),
                LayerCarry::Kv => Vec::new(),
            })
            .collect()
    }

    /// The carry state as bytes (see the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let mut arrays: Vec<&[bf16]> = Vec::new();
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                LayerCarry::Kv => WireLayer::Kv,
                LayerCarry::V4(c) => {
                    arrays.push(&c.window);
                    let pools = c
                        .pools
                        .iter()
                        .map(|p| {
                            arrays.push(&p.buf_kv);
                            arrays.push(&p.buf_gate);
                            if let Some([k, g]) = &p.prev {
                                arrays.push(k);
                                arrays.push(g);
                            }
                            WirePool {
                                width: p.width as u64,
                                pooled_rows: p.pooled_rows as u64,
                                rem_values: p.buf_kv.len() as u64,
                                prev_values: p.prev.as_ref().map(|[k, _]| k.len() as u64),
                            }
                        })
                        .collect();
                    WireLayer::V4 { sliding_window: c.sliding_window as u64, ratio: c.ratio as u64, head_dim: c.head_dim as u64, window_values: c.window.len() as u64, pools }
                }
            })
            .collect();
        let header = WireHeader {
            omlx_format: self.format.name().to_string(),
            fingerprint: self.fingerprint.clone(),
            block_size: self.block_size as u64,
            position: self.position as u64,
            chain_hash: self.chain_hash.map(|h| h.hex()),
            layers,
        };
        let head = serde_json::to_vec(&header).expect("carry header serializes");
        let body: usize = arrays.iter().map(|a| a.len() * 2).sum();
        frame(MAGIC, CARRY_VERSION, &head, body, |out| {
            for a in arrays {
                for v in a {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            }
        })
    }

    /// Parse carry-state bytes; every length is checked against the bytes present. The result is
    /// not yet checked against a model ([`Self::check_for`]).
    pub fn decode(bytes: &[u8]) -> Result<CarryState> {
        let framing = |r: String| err(CarryField::Framing, r);
        let (head, mut body) = unframe(bytes, MAGIC, CARRY_VERSION, "carry state")?;
        let h: WireHeader = serde_json::from_slice(head).map_err(|e| framing(format!("header: {e}")))?;
        let format = OmlxFormat::from_name(&h.omlx_format).map_err(|e| err(CarryField::Format, e.to_string()))?;
        let mut take = |values: u64| -> Result<Vec<bf16>> {
            let bytes = usize::try_from(values).ok().and_then(|v| v.checked_mul(2)).filter(|&b| b <= body.len());
            let bytes = bytes.ok_or_else(|| framing(format!("an array of {values} values overruns the payload ({} bytes left)", body.len())))?;
            let (a, rest) = body.split_at(bytes);
            body = rest;
            Ok(a.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect())
        };
        let size = |v: u64| usize::try_from(v).map_err(|_| framing(format!("{v} does not fit this host")));
        let mut layers = Vec::with_capacity(h.layers.len());
        for l in &h.layers {
            layers.push(match l {
                WireLayer::Kv => LayerCarry::Kv,
                WireLayer::V4 { sliding_window, ratio, head_dim, window_values, pools } => {
                    let window = take(*window_values)?;
                    let mut out = Vec::with_capacity(pools.len());
                    for p in pools {
                        let buf_kv = take(p.rem_values)?;
                        let buf_gate = take(p.rem_values)?;
                        let prev = match p.prev_values {
                            Some(v) => Some([take(v)?, take(v)?]),
                            None => None,
                        };
                        out.push(PoolCarry { width: size(p.width)?, pooled_rows: size(p.pooled_rows)?, buf_kv, buf_gate, prev });
                    }
                    LayerCarry::V4(V4Carry { sliding_window: size(*sliding_window)?, ratio: size(*ratio)?, head_dim: size(*head_dim)?, window, pools: out })
                }
            });
        }
        if !body.is_empty() {
            return Err(framing(format!("{} trailing bytes after the last array", body.len())));
        }
        let chain_hash = match &h.chain_hash {
            Some(s) => Some(ChainHash::from_hex(s).ok_or_else(|| framing(format!("chain hash {s:?} is not 64 hex digits")))?),
            None => None,
        };
        Ok(CarryState { format, fingerprint: h.fingerprint, block_size: size(h.block_size)?, position: size(h.position)?, chain_hash, layers })
    }
}

#[derive(Serialize, Deserialize)]
struct WireHeader {
    omlx_format: String,
    fingerprint: String,
    block_size: u64,
    position: u64,
    chain_hash: Option<String>,
    layers: Vec<WireLayer>,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum WireLayer {
    V4 { sliding_window: u64, ratio: u64, head_dim: u64, window_values: u64, pools: Vec<WirePool> },
    Kv,
}

#[derive(Serialize, Deserialize)]
struct WirePool {
    width: u64,
    pooled_rows: u64,
    /// Values of `buf_kv` (and of `buf_gate`).
    rem_values: u64,
    /// Values of each previous-window array, if there is one.
    prev_values: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CarryState {
        let v = |n: usize| (0..n).map(|i| bf16::from_f32(i as f32 - 3.0)).collect::<Vec<_>>();
        CarryState {
            format: OmlxFormat::Upstream063,
            fingerprint: "sha256:ab".into(),
            block_size: 8,
            position: 16,
            chain_hash: Some(ChainHash([7; 32])),
            layers: vec![
                LayerCarry::V4(V4Carry { sliding_window: 4, ratio: 0, head_dim: 2, window: v(8), pools: vec![] }),
                LayerCarry::V4(V4Carry {
                    sliding_window: 4,
                    ratio: 4,
                    head_dim: 2,
                    window: v(8),
                    pools: vec![PoolCarry { width: 4, pooled_rows: 4, buf_kv: vec![], buf_gate: vec![], prev: Some([v(16), v(16)]) }],
                }),
                LayerCarry::Kv,
            ],
        }
    }

    #[test]
    fn bytes_round_trip_and_damage_is_refused_by_name() {
        let c = sample();
        let b = c.encode();
        assert_eq!(CarryState::decode(&b).unwrap(), c);
        for cut in [0, 3, 15, b.len() - 1] {
            assert!(matches!(CarryState::decode(&b[..cut]), Err(CoreError::Carry { what: CarryField::Framing, .. })), "cut {cut}");
        }
        let mut flipped = b.clone();
        flipped[b.len() / 2] ^= 1;
        assert!(CarryState::decode(&flipped).unwrap_err().to_string().contains("checksum"));
        let mut newer = b.clone();
        newer[4] = 2;
        assert!(CarryState::decode(&newer).unwrap_err().to_string().contains("version 2"));
    }
}
