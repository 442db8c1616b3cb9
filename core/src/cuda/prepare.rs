//! A device made ready before its first capture: the decoder's weights resident and the kernels
//! loaded ([`GpuModel::shared`]), and the pools of block bodies filled — device staging bodies
//! for the blocks a capture keeps in flight, page-locked host bodies for those plus the finished
//! segments the segment server may hold. Without it the first requests (and any that find the
//! pools short) upload weights, compile kernels, and allocate and pin memory on the prefill
//! engine's forward thread: the stalls issue 23 measured.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::capture::{blocks_in_flight, declines};
use super::dev::{PinnedLease, StagingLease, NEW_BUFFERS, PINNED_IDLE_MAX, STAGING_IDLE_MAX};
use super::model::GpuModel;
use crate::backend::{DevicePreparation, Prepared};
use crate::error::{CoreError, Result};
use crate::segment::SegmentPlan;

/// Page-locked bodies are allocated in whole 2 MiB pages ([`PinnedLease::take`]).
fn pinned_size(bytes: usize) -> usize {
    bytes.div_ceil(1 << 21) << 21
}

pub(crate) fn prepare(p: &DevicePreparation) -> Result<Prepared> {
    let t = Instant::now();
    if p.captures == 0 || p.step_tokens == 0 {
        return Err(CoreError::config("captures", format!("preparing for {} captures of {}-token steps: both must be at least 1", p.captures, p.step_tokens)));
    }
    let geometry = crate::family::geometry(&p.weights.plan, p.format, p.block_size);
    let mut plan = SegmentPlan::new(geometry, "prepare", &p.weights.fingerprint);
    if let Some(layers) = &p.stage {
        plan = plan.for_stage(layers.clone())?;
    }
    if let Some(why) = declines(p.format, &plan, &p.options) {
        return Ok(Prepared { declined: Some(why), seconds: t.elapsed().as_secs_f64(), ..Prepared::default() });
    }
    let model = GpuModel::shared(p.weights.clone(), p.device)?;
    // The first blocks lack the previous windows later ones carry: the largest of the first few
    // is every later block's size.
    let values = (0..4).map(|k| plan.block(k).values).max().unwrap_or(0).max(1);
    let body = values * 2;
    let staging = (p.captures * blocks_in_flight(p.options.open_blocks, p.step_tokens, p.block_size)).min(STAGING_IDLE_MAX / body);
    let pinned = (staging + p.held_bytes / body).min(PINNED_IDLE_MAX / pinned_size(body));
    model.dev.bind()?;
    let before = NEW_BUFFERS.load(Ordering::Relaxed);
    // Held together, then returned: each take finds the previous ones in use, so the pools end
    // up holding this many (those idle already are reused, not doubled).
    let bodies = (0..staging).map(|_| StagingLease::take(&model.dev, body)).collect::<Result<Vec<_>>>()?;
    let pages = (0..pinned).map(|_| PinnedLease::take(&model.dev, values)).collect::<Result<Vec<_>>>()?;
    drop(bodies);
    drop(pages);
    // Not the captures' allocations: the per-seal count stays theirs.
    let allocated = NEW_BUFFERS.load(Ordering::Relaxed).saturating_sub(before);
    let _ = NEW_BUFFERS.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(allocated)));
    Ok(Prepared {
        body_bytes: body,
        staging_bodies: staging,
        pinned_bodies: pinned,
        staging_bytes: staging * body,
        pinned_bytes: pinned * pinned_size(body),
        allocated: allocated as usize,
        seconds: t.elapsed().as_secs_f64(),
        declined: None,
    })
}
