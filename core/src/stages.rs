//! Pipeline stages: one capture's layers from several prefill processes.
//!
//! Under vLLM's pipeline parallelism each stage runs a contiguous range of the model's layers in
//! its own process, often on its own host, and no process sees every layer's attention input. So
//! each stage captures its own layers ([`crate::capture::Capture::for_stage`]) and serves them on
//! its own segment port (the base port + the stage); its segments say which layer they start at
//! ([`crate::segment::SegmentHeader::first_layer`]). The decode host pulls every stage and joins
//! the stages' segments of a block into the whole block's segment, in layer order, before the
//! block writer sees it ([`join`]). A block is written only when its parts cover every layer
//! exactly once, so a stage that fails gives the capture a shorter prefix ([`end`]), never a
//! block missing a layer.

use crate::error::{CoreError, Result};
use crate::segment::{Segment, SegmentHeader};
use crate::wire::Seal;

/// The most pipeline stages one capture is pulled from.
pub const MAX_STAGES: u8 = 16;

/// The stages' segments of one block, in stage order, joined into the block's whole segment.
/// Each part must be the same block of the same capture, and start at the layer the parts before
/// it end at (the first at layer 0).
pub fn join(parts: Vec<Segment>) -> Result<Segment> {
    let stages = parts.len();
    let mut parts = parts.into_iter();
    let first = parts.next().ok_or_else(|| CoreError::wire("no pipeline stage's part to join"))?;
    let head = &first.header;
    let mut header = SegmentHeader { first_layer: 0, layers: Vec::new(), ..head.clone() };
    let mut arrays: Vec<Vec<half::bf16>> = Vec::new();
    for (s, part) in std::iter::once(first).chain(parts).enumerate() {
        let h = &part.header;
        let name = format!("pipeline stage {} of {stages}", s + 1);
        if (h.index, h.start, h.end) != (header.index, header.start, header.end) || h.request_id != header.request_id || h.fingerprint != header.fingerprint || h.omlx_format != header.omlx_format {
            return Err(CoreError::wire(format!("{name} sent block {} [{}, {}) of {:?} where block {} [{}, {}) of {:?} was due", h.index, h.start, h.end, h.request_id, header.index, header.start, header.end, header.request_id)));
        }
        let at = header.layers.len();
        if h.first_layer as usize != at || h.layers.is_empty() {
            return Err(CoreError::wire(format!("{name} sent layers {}..{} of block {} where layer {at} was due", h.first_layer, h.first_layer as usize + h.layers.len(), h.index)));
        }
        header.layers.extend(h.layers.iter().cloned());
        arrays.extend(part.arrays.iter().map(<[half::bf16]>::to_vec));
    }
    Ok(Segment { header, arrays: arrays.into() })
}

/// What one stage said in a round of the join: its part of the block due, or its seal.
pub enum Said {
    Part(Segment),
    Seal(Seal),
}

/// The capture's seal, or `None` to go on: `said` is what stages `0..said.len()` of `stages`
/// said in the round for block `next` so far. A stage that sealed anything but `complete` ends
/// the capture at `next` with its reason (the first such stage, in stage order), without waiting
/// for the rest of the round. When the whole round sealed `complete`, so is the capture; when it
/// sent parts only, `None` (join them). A stage sealed `complete` while another sent a part of
/// block `next` is a stream fault: the stages disagree on the prompt.
pub fn end(said: &[Said], stages: usize, next: u32) -> Result<Option<Seal>> {
    let name = |s: usize| format!("pipeline stage {} of {stages}", s + 1);
    for (s, x) in said.iter().enumerate() {
        if let Said::Seal(seal) = x {
            if seal.blocks() != next {
                return Err(CoreError::wire(format!("{} sealed {} blocks where {next} arrived", name(s), seal.blocks())));
            }
            match seal {
                Seal::Complete { .. } => {}
                Seal::Partial { blocks, tokens, reason } => return Ok(Some(Seal::Partial { blocks: *blocks, tokens: *tokens, reason: format!("{}: {reason}", name(s)) })),
                Seal::Aborted { blocks, reason } => return Ok(Some(Seal::Aborted { blocks: *blocks, reason: format!("{}: {reason}", name(s)) })),
            }
        }
    }
    let sealed = said.iter().position(|x| matches!(x, Said::Seal(_)));
    let part = said.iter().position(|x| matches!(x, Said::Part(_)));
    match (sealed, part) {
        (Some(c), Some(p)) => Err(CoreError::wire(format!("{} sealed complete at {next} blocks while {} sent block {next}: the stages disagree on the prompt", name(c), name(p)))),
        (Some(c), None) if said.len() == stages => match &said[c] {
            Said::Seal(seal) => Ok(Some(seal.clone())),
            Said::Part(_) => Ok(None),
        },
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::segment::{ArrayShape, LayerHeader, LayerKind};
    use half::bf16;

    fn part(index: u32, first_layer: u32, layers: usize) -> Segment {
        let layer = LayerHeader { kind: LayerKind::Kv, arrays: vec![ArrayShape { rows: 1, width: 2 }, ArrayShape { rows: 1, width: 1 }] };
        let arrays: Vec<Vec<bf16>> = (0..layers)
            .flat_map(|l| {
                let v = bf16::from_f32((first_layer as usize + l) as f32);
                [vec![v, v], vec![v]]
            })
            .collect();
        let header = SegmentHeader { request_id: "r".into(), fingerprint: "f".into(), omlx_format: "upstream-0.6.3".into(), index, start: 4 * index as u64, end: 4 * index as u64 + 4, first_layer, layers: vec![layer; layers] };
        Segment { header, arrays: arrays.into() }
    }

    #[test]
    fn parts_join_in_layer_order_into_the_whole_segment() {
        let whole = join(vec![part(2, 0, 2), part(2, 2, 1)]).unwrap();
        assert_eq!(whole, part(2, 0, 3));
        assert!(join(vec![part(2, 0, 1), part(2, 2, 1)]).unwrap_err().to_string().contains("layers 2..3 of block 2 where layer 1 was due"));
        assert!(join(vec![part(2, 1, 2), part(2, 3, 1)]).is_err(), "the first part starts at layer 0");
        assert!(join(vec![part(2, 0, 2), part(3, 2, 1)]).unwrap_err().to_string().contains("pipeline stage 2 of 2 sent block 3"));
        assert!(join(vec![]).is_err());
        // A part's own header round-trips; a whole block's has no first_layer on the wire.
        let p = part(0, 2, 1);
        assert_eq!(Segment::decode(&p.encode()).unwrap(), p);
        assert!(!String::from_utf8_lossy(&part(0, 0, 1).encode()).contains("first_layer"));
    }

    #[test]
    fn the_capture_ends_with_the_first_stage_that_did_not_complete() {
        let complete = |b: u32| Said::Seal(Seal::Complete { blocks: b, tokens: 4 * b as u64 });
        assert!(end(&[Said::Part(part(3, 0, 1)), Said::Part(part(3, 1, 2))], 2, 3).unwrap().is_none());
        assert!(end(&[complete(3)], 2, 3).unwrap().is_none(), "the round is not over");
        assert_eq!(end(&[complete(3), complete(3)], 2, 3).unwrap(), Some(Seal::Complete { blocks: 3, tokens: 12 }));
        let aborted = end(&[Said::Part(part(3, 0, 1)), Said::Seal(Seal::Aborted { blocks: 3, reason: "worker died".into() })], 3, 3).unwrap();
        assert_eq!(aborted, Some(Seal::Aborted { blocks: 3, reason: "pipeline stage 2 of 3: worker died".into() }));
        let partial = end(&[Said::Seal(Seal::Partial { blocks: 3, tokens: 12, reason: "cut".into() })], 2, 3).unwrap();
        assert!(matches!(partial, Some(Seal::Partial { blocks: 3, ref reason, .. }) if reason == "pipeline stage 1 of 2: cut"));
        assert!(end(&[complete(3), Said::Part(part(3, 1, 2))], 2, 3).unwrap_err().to_string().contains("disagree"));
        assert!(end(&[complete(4)], 2, 3).unwrap_err().to_string().contains("sealed 4 blocks where 3 arrived"));
    }
}
