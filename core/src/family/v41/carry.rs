//! DeepSeek-V4.1's carry state: what its cache math needs to continue a request from position
//! `S` instead of token 0.
//!
//! Per layer that is the window's rows (the last `min(S, sliding_window)`, bf16) and, on a ratio-2
//! pool, the rows of the unfinished group (`pending_kv`, `pending_gate`: `S % 2` float32 rows).
//! Compressed rows and index keys are not carried: every later group depends only on rows from
//! `S` on and the pending rows, and the decoder already holds the earlier ones. Nothing else in
//! mlx-lm's `LayerCache` crosses `S`.
//!
//! oMLX's V4.1 block format is not known here, so there is no block file to read this from; it
//! is made by [`super::V41CacheBuilder::carry`] (or from the decoder's `LayerCache`, whose fields
//! it mirrors) and names the weights fingerprint and `S`.
//!
//! Bytes ([`V41Carry::encode`]): `"PD41" | version u32 LE | header length u32 LE | header JSON |
//! per layer: window (LE bf16), pending_kv, pending_gate (LE f32) | crc32 u32 LE of everything
//! before it`.

use half::bf16;
use serde::{Deserialize, Serialize};

use super::plan::V41Plan;
use crate::error::{CarryField, Result};
use crate::pooler::carry::{err, frame, unframe};

/// Version of the bytes this build writes and reads.
pub const V41_CARRY_VERSION: u32 = 1;
const MAGIC: &[u8; 4] = b"PD41";

/// One layer's carry.
#[derive(Clone, Debug, PartialEq)]
pub struct V41LayerCarry {
    /// `[min(S, sliding_window), head_dim]`, oldest first.
    pub window: Vec<bf16>,
    /// `[S % ratio, head_dim]` each on a ratio-2 pool; empty otherwise.
    pub pending_kv: Vec<f32>,
    pub pending_gate: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct V41Carry {
    pub fingerprint: String,
    /// `S`: tokens before the resume point.
    pub position: usize,
    pub layers: Vec<V41LayerCarry>,
}

#[derive(Serialize, Deserialize)]
struct Header {
    fingerprint: String,
    position: u64,
    /// Per layer: values of the window, and of each pending array.
    layers: Vec<(u64, u64)>,
}

impl V41Carry {
    /// Refuse the carry state unless it was made from these weights and fits `plan` at its
    /// position.
    pub fn check(&self, fingerprint: &str, plan: &V41Plan) -> Result<()> {
        if self.fingerprint != fingerprint {
            return Err(err(CarryField::Fingerprint, format!("made from weights {}, these are {fingerprint}", self.fingerprint)));
        }
        let s = self.position;
        if s == 0 {
            return Err(err(CarryField::Position, "position 0: there is nothing to resume from"));
        }
        if self.layers.len() != plan.num_layers {
            return Err(err(CarryField::Plan, format!("{} layers, the model has {}", self.layers.len(), plan.num_layers)));
        }
        let hd = plan.head_dim;
        for (i, c) in self.layers.iter().enumerate() {
            let rows = s.min(plan.sliding_window);
            if c.window.len() != rows * hd {
                return Err(err(CarryField::Position, format!("layer {i}: window of {} values; at token {s} it holds {rows} rows of {hd}", c.window.len())));
            }
            let kind = plan.layer_kind(i);
            let pending = if kind.pools && kind.ratio > 1 { s % kind.ratio } else { 0 };
            if c.pending_kv.len() != pending * hd || c.pending_gate.len() != pending * hd {
                return Err(err(
                    CarryField::Position,
                    format!("layer {i}: pending rows of {}/{} values; at token {s} it holds {pending} rows of {hd}", c.pending_kv.len(), c.pending_gate.len()),
                ));
            }
        }
        Ok(())
    }

    pub fn encode(&self) -> Vec<u8> {
        let header = Header {
            fingerprint: self.fingerprint.clone(),
            position: self.position as u64,
            layers: self.layers.iter().map(|l| (l.window.len() as u64, l.pending_kv.len() as u64)).collect(),
        };
        let head = serde_json::to_vec(&header).expect("carry header serializes");
        let body: usize = self.layers.iter().map(|l| 2 * l.window.len() + 4 * (l.pending_kv.len() + l.pending_gate.len())).sum();
        frame(MAGIC, V41_CARRY_VERSION, &head, body, |out| {
            for l in &self.layers {
                out.extend(l.window.iter().flat_map(|v| v.to_le_bytes()));
                out.extend(l.pending_kv.iter().flat_map(|v| v.to_le_bytes()));
                out.extend(l.pending_gate.iter().flat_map(|v| v.to_le_bytes()));
            }
        })
    }

    /// Parse carry-state bytes, every length checked against the bytes present; not yet checked
    /// against a model ([`Self::check`]).
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let framing = |r: String| err(CarryField::Framing, r);
        let (head, mut body) = unframe(bytes, MAGIC, V41_CARRY_VERSION, "DeepSeek-V4.1 carry state")?;
        let h: Header = serde_json::from_slice(head).map_err(|e| framing(format!("header: {e}")))?;
        let mut take = |values: u64, width: usize| -> Result<&[u8]> {
            let len = usize::try_from(values).ok().and_then(|v| v.checked_mul(width)).filter(|&b| b <= body.len());
            let len = len.ok_or_else(|| framing(format!("an array of {values} values overruns the payload ({} bytes left)", body.len())))?;
            let (a, rest) = body.split_at(len);
            body = rest;
            Ok(a)
        };
        let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>();
        let mut layers = Vec::with_capacity(h.layers.len().min(1 << 12));
        for &(w, p) in &h.layers {
            let window = take(w, 2)?.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]])).collect();
            let pending_kv = f32s(take(p, 4)?);
            let pending_gate = f32s(take(p, 4)?);
            layers.push(V41LayerCarry { window, pending_kv, pending_gate });
        }
        if !body.is_empty() {
            return Err(framing(format!("{} trailing bytes after the last array", body.len())));
        }
        let position = usize::try_from(h.position).map_err(|_| framing(format!("position {} does not fit this host", h.position)))?;
        Ok(V41Carry { fingerprint: h.fingerprint, position, layers })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CoreError;

    #[test]
    fn bytes_round_trip_and_damage_is_refused() {
        let c = V41Carry {
            fingerprint: "sha256:ab".into(),
            position: 7,
            layers: vec![
                V41LayerCarry { window: (0..8).map(|i| bf16::from_f32(i as f32)).collect(), pending_kv: vec![], pending_gate: vec![] },
                V41LayerCarry { window: vec![bf16::ONE; 8], pending_kv: vec![1.5, -0.0], pending_gate: vec![f32::MIN_POSITIVE, 3.0] },
            ],
        };
        let b = c.encode();
        assert_eq!(V41Carry::decode(&b).unwrap(), c);
        for cut in [0, 3, 15, b.len() - 1] {
            assert!(matches!(V41Carry::decode(&b[..cut]), Err(CoreError::Carry { what: CarryField::Framing, .. })), "cut {cut}");
        }
        let mut flipped = b.clone();
        flipped[b.len() / 2] ^= 1;
        assert!(V41Carry::decode(&flipped).unwrap_err().to_string().contains("checksum"));
    }
}
