//! Segments: the decoder's finished cache state at one oMLX block boundary, as the prefill host
//! ships it and the decode host writes it. Model-agnostic: a segment carries per-layer arrays in
//! the shape the block layout needs ([`LayerView`]), the weights fingerprint and token positions.

use half::bf16;
use serde::{Deserialize, Serialize};

use crate::error::{CoreError, Result};
use crate::view::{ArrayView, LayerView, V4BlockView};

mod body;
mod build;
pub use body::{BodyStore, SegmentArrays};
pub use build::{ArraySource, BlockPlan, PlannedArray, PlannedLayer, SegmentPlan};

/// How a layer's arrays are to be read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LayerKind {
    /// DeepSeek-V4: `arrays[0]` the window, then `[buf_kv, buf_gate, pooled]` per pool, where
    /// `pooled` holds pool rows from `pool_starts[i]` on (0: the whole pool; a streaming capture
    /// sends only the rows new since the previous segment); for a decoder that carries the
    /// ratio-4 overlap (upstream) each pool adds `[prev_kv, prev_gate]` (0 rows: none).
    V4 { offset: u64, sliding_window: u32, ratio: u32, pool_starts: Vec<u64> },
    /// A plain KV slice: `arrays = [keys, values]`.
    Kv,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArrayShape {
    pub rows: u32,
    pub width: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerHeader {
    #[serde(flatten)]
    pub kind: LayerKind,
    pub arrays: Vec<ArrayShape>,
}

/// Everything about a segment but its array bytes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SegmentHeader {
    pub request_id: String,
    pub fingerprint: String,
    /// The oMLX block format the capture computed for ([`crate::OmlxFormat::name`]); the
    /// decode host refuses a segment made for another. Absent in older peers: the fork's.
    #[serde(default = "fork_format")]
    pub omlx_format: String,
    /// Block index in the request's chain.
    pub index: u32,
    /// The block covers tokens `[start, end)`.
    pub start: u64,
    pub end: u64,
    /// The model layer `layers[0]` is: a pipeline stage ships only its own layers
    /// ([`crate::stages`]); 0, and absent on the wire, for a whole block.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub first_layer: u32,
    pub layers: Vec<LayerHeader>,
}

fn is_zero(x: &u32) -> bool {
    *x == 0
}

fn fork_format() -> String {
    crate::OmlxFormat::Fork070.name().to_string()
}

/// A segment with its arrays, owned (as received or about to be sent).
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    pub header: SegmentHeader,
    /// All arrays of all layers, in header order: spans of one contiguous body.
    pub arrays: SegmentArrays,
}

impl Segment {
    /// Capture the block `[start, end)`'s state from per-layer views (tests and the direct block
    /// path; the capture engine builds segments through [`SegmentPlan`]).
    pub fn from_views(format: crate::OmlxFormat, request_id: &str, fingerprint: &str, index: u32, start: u64, end: u64, views: &[LayerView<'_>]) -> Segment {
        let mut layers = Vec::with_capacity(views.len());
        let mut arrays: Vec<Vec<bf16>> = Vec::new();
        let mut push = |a: &ArrayView<'_>, shapes: &mut Vec<ArrayShape>| {
            shapes.push(ArrayShape { rows: a.rows as u32, width: a.width as u32 });
            arrays.push(a.data.to_vec());
        };
        for v in views {
            let mut shapes = Vec::new();
            let kind = match v {
                LayerView::V4(v) => {
                    push(&v.window, &mut shapes);
                    let carried = format.overlap() == crate::format::Overlap::Carried;
                    for (j, pool) in v.pools.iter().enumerate() {
                        for a in pool {
                            push(a, &mut shapes);
                        }
                        if carried {
                            let empty = ArrayView { rows: 0, width: pool[0].width, data: &[] };
                            let [pk, pg] = v.prev.get(j).copied().flatten().unwrap_or([empty, empty]);
                            push(&pk, &mut shapes);
                            push(&pg, &mut shapes);
                        }
                    }
                    LayerKind::V4 { offset: v.offset as u64, sliding_window: v.sliding_window as u32, ratio: v.ratio as u32, pool_starts: v.pool_first.iter().map(|&f| f as u64).collect() }
                }
                LayerView::Kv(k, val) => {
                    push(k, &mut shapes);
                    push(val, &mut shapes);
                    LayerKind::Kv
                }
            };
            layers.push(LayerHeader { kind, arrays: shapes });
        }
        Segment { header: SegmentHeader { request_id: request_id.into(), fingerprint: fingerprint.into(), omlx_format: format.name().into(), index, start, end, first_layer: 0, layers }, arrays: arrays.into() }
    }

    /// Borrow the segment as per-layer views for the block writer. Pools stay as the segment
    /// carries them (`pool_first` says from which row): enough for a delta-pool format; a
    /// full-pool format needs the accumulated pools of [`crate::block::assembler::Assembler`].
    pub fn views(&self) -> Result<Vec<LayerView<'_>>> {
        self.views_with(|_, _| None)
    }

    /// Views where `pool(layer, i)` may supply layer `layer`'s accumulated pool `i` in place of
    /// the segment's own pooled array.
    pub fn views_with<'a>(&'a self, pool: impl Fn(usize, usize) -> Option<&'a [bf16]>) -> Result<Vec<LayerView<'a>>> {
        let mut next = self.arrays.iter();
        let mut out = Vec::with_capacity(self.header.layers.len());
        for (i, layer) in self.header.layers.iter().enumerate() {
            let mut take = |s: &ArrayShape| -> Result<ArrayView<'_>> {
                let data = next.next().ok_or_else(|| CoreError::wire(format!("layer {i}: fewer arrays than the header lists")))?;
                if data.len() != s.rows as usize * s.width as usize {
                    return Err(CoreError::wire(format!("layer {i}: array of {} values, header says {}x{}", data.len(), s.rows, s.width)));
                }
                Ok(ArrayView { rows: s.rows as usize, width: s.width as usize, data })
            };
            out.push(match &layer.kind {
                &LayerKind::V4 { offset, sliding_window, ratio, ref pool_starts } => {
                    let Some((window, rest)) = layer.arrays.split_first() else {
                        return Err(CoreError::wire(format!("layer {i}: a V4 layer needs a window")));
                    };
                    let arity = if pool_starts.is_empty() { 3 } else { rest.len() / pool_starts.len() };
                    if (arity != 3 && arity != 5) || rest.len() != arity * pool_starts.len() || (ratio == 0) != rest.is_empty() {
                        return Err(CoreError::wire(format!("layer {i}: {} pool arrays, {} pool starts, ratio {ratio}", rest.len(), pool_starts.len())));
                    }
                    let window = take(window)?;
                    let (mut pools, mut pool_first, mut prev) = (Vec::new(), Vec::new(), Vec::new());
                    for (j, p) in rest.chunks_exact(arity).enumerate() {
                        let (kv, gate, own) = (take(&p[0])?, take(&p[1])?, take(&p[2])?);
                        let (pooled, first) = match pool(i, j) {
                            Some(all) => (ArrayView::new(own.width, all), 0),
                            None => (own, pool_starts[j] as usize),
                        };
                        pools.push([kv, gate, pooled]);
                        pool_first.push(first);
                        prev.push(if arity == 5 {
                            let (pk, pg) = (take(&p[3])?, take(&p[4])?);
                            (pk.rows > 0).then_some([pk, pg])
                        } else {
                            None
                        });
                    }
                    LayerView::V4(V4BlockView { offset: offset as usize, sliding_window: sliding_window as usize, ratio: ratio as usize, window, pools, pool_first, prev })
                }
                LayerKind::Kv => {
                    let [k, v] = layer.arrays.as_slice() else {
                        return Err(CoreError::wire(format!("layer {i}: a KV layer has exactly two arrays")));
                    };
                    LayerView::Kv(take(k)?, take(v)?)
                }
            });
        }
        if next.next().is_some() {
            return Err(CoreError::wire("more arrays than the header lists"));
        }
        Ok(out)
    }

    /// Payload bytes: u32 LE header length, the header as JSON, then every array as LE bf16.
    pub fn encode(&self) -> Vec<u8> {
        let head = self.payload_head();
        let body = self.body_bytes();
        let mut out = Vec::with_capacity(head.len() + body.len());
        out.extend_from_slice(&head);
        out.extend_from_slice(body);
        out
    }

    /// The payload up to the body (length prefix and header JSON): a sender writes it and then
    /// [`Self::body_bytes`] as they lie, without assembling the payload.
    pub fn payload_head(&self) -> Vec<u8> {
        let header = serde_json::to_vec(&self.header).expect("segment header serializes");
        let mut out = Vec::with_capacity(4 + header.len());
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        out
    }

    /// The arrays as the payload carries them (LE bf16, back to back).
    pub fn body_bytes(&self) -> &[u8] {
        self.arrays.body_bytes()
    }

    /// Parse a payload; every length is checked against the bytes actually present.
    pub fn decode(payload: &[u8]) -> Result<Segment> {
        let n = payload.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize).ok_or_else(|| CoreError::wire("segment shorter than its length prefix"))?;
        let head = payload.get(4..4 + n).ok_or_else(|| CoreError::wire(format!("segment header of {n} bytes overruns the payload")))?;
        let header: SegmentHeader = serde_json::from_slice(head).map_err(|e| CoreError::wire(format!("segment header: {e}")))?;
        if header.end <= header.start {
            return Err(CoreError::wire(format!("segment covers an empty range [{}, {})", header.start, header.end)));
        }
        let mut body = &payload[4 + n..];
        let whole = body;
        let mut lens = Vec::new();
        for s in header.layers.iter().flat_map(|l| &l.arrays) {
            let bytes = (s.rows as usize).checked_mul(s.width as usize).and_then(|v| v.checked_mul(2)).ok_or_else(|| CoreError::wire("array size overflows"))?;
            if bytes > body.len() {
                return Err(CoreError::wire(format!("array {}x{} overruns the payload ({} bytes left)", s.rows, s.width, body.len())));
            }
            lens.push(bytes / 2);
            body = &body[bytes..];
        }
        if !body.is_empty() {
            return Err(CoreError::wire(format!("{} trailing bytes after the last array", body.len())));
        }
        let arrays = SegmentArrays::from_le_bytes(whole, &lens)?;
        Ok(Segment { header, arrays })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Segment {
        let w: Vec<bf16> = (0..12).map(|i| bf16::from_f32(i as f32)).collect();
        let p: Vec<bf16> = (0..4).map(|i| bf16::from_f32(-(i as f32))).collect();
        let views = vec![
            LayerView::V4(V4BlockView {
                offset: 8,
                sliding_window: 4,
                ratio: 4,
                window: ArrayView::new(3, &w),
                pools: vec![[ArrayView::new(4, &[]), ArrayView::new(4, &[]), ArrayView::new(2, &p)]],
                pool_first: vec![0],
                prev: vec![None],
            }),
            LayerView::Kv(ArrayView::new(3, &w[..6]), ArrayView::new(2, &p)),
        ];
        Segment::from_views(crate::OmlxFormat::Fork070, "req-1", "sha256:ab", 1, 4, 8, &views)
    }

    #[test]
    fn round_trips_and_views_match() {
        let s = sample();
        let d = Segment::decode(&s.encode()).unwrap();
        assert_eq!(d, s);
        let v = d.views().unwrap();
        match &v[0] {
            LayerView::V4(x) => assert_eq!((x.window.rows, x.pools[0][2].rows, x.ratio), (4, 2, 4)),
            _ => panic!(),
        }
    }

    #[test]
    fn hostile_payloads_are_rejected() {
        let good = sample().encode();
        for cut in [0, 3, 10, good.len() - 1] {
            assert!(Segment::decode(&good[..cut]).is_err(), "cut {cut}");
        }
        let mut extra = good.clone();
        extra.push(0);
        assert!(Segment::decode(&extra).unwrap_err().to_string().contains("trailing"));
        let mut huge = sample();
        huge.header.layers[0].arrays[0].rows = u32::MAX;
        assert!(Segment::decode(&huge.encode()).is_err());
        let mut bad = sample();
        bad.arrays.pop();
        assert!(bad.views().is_err());
    }
}
