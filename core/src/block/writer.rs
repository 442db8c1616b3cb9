//! The block writer: one request's full blocks, written into an oMLX cache directory as the
//! pooler reaches each block boundary. Memory is one block at a time, whatever the prompt length.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use super::chain::{chain, ChainHash};
use super::file::{write_pending, Tensor};
use super::layout::{block_contents, contents, LayerView};
use crate::error::{CoreError, Result};
use crate::format::OmlxFormat;
use crate::pooler::LayerState;
use crate::segment::Segment;

/// Where oMLX keeps a block: `<cache_dir>/<hex[0]>/<hex>.safetensors`.
pub fn block_path(cache_dir: &Path, hash: &ChainHash) -> PathBuf {
    let hex = hash.hex();
    cache_dir.join(&hex[..1]).join(format!("{hex}.safetensors"))
}

/// What writing one block did.
#[derive(Debug, Clone)]
pub struct Written {
    pub path: PathBuf,
    pub bytes: u64,
    /// The block already existed and was left as it was (blocks are immutable once named).
    pub existed: bool,
}

pub struct BlockWriter {
    format: OmlxFormat,
    cache_dir: PathBuf,
    model_name: String,
    block_size: usize,
    chain: Vec<ChainHash>,
    /// The block being flushed on the helper thread, and its final path.
    in_flight: Mutex<Option<(PathBuf, JoinHandle<Result<u64>>)>>,
}

impl BlockWriter {
    /// Blocks for the fork (flyto-mlx 0.7.0); see [`Self::with_format`].
    pub fn new(cache_dir: impl Into<PathBuf>, model_name: impl Into<String>, block_size: usize, tokens: &[u32]) -> Result<Self> {
        Self::with_format(OmlxFormat::Fork070, cache_dir, model_name, block_size, tokens)
    }

    /// `tokens`: the request's token ids as oMLX tokenized them; `model_name`: oMLX's model
    /// string (per [`OmlxFormat::model_name_rule`]: the fork's model directory path, upstream's
    /// model id); `block_size`: oMLX's block size.
    pub fn with_format(format: OmlxFormat, cache_dir: impl Into<PathBuf>, model_name: impl Into<String>, block_size: usize, tokens: &[u32]) -> Result<Self> {
        if block_size == 0 {
            return Err(CoreError::config("block_size", "must be positive"));
        }
        let model_name = model_name.into();
        let chain = chain(&model_name, tokens, block_size);
        Ok(BlockWriter { format, cache_dir: cache_dir.into(), model_name, block_size, chain, in_flight: Mutex::new(None) })
    }

    pub fn format(&self) -> OmlxFormat {
        self.format
    }

    pub fn num_blocks(&self) -> usize {
        self.chain.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn hash(&self, index: usize) -> Option<&ChainHash> {
        self.chain.get(index)
    }

    /// Write block `index` from layer states that have processed exactly its end boundary.
    pub fn write(&self, index: usize, layers: &[LayerState]) -> Result<Written> {
        let (hash, path, existing) = self.target(index)?;
        if let Some(w) = existing {
            return Ok(w);
        }
        let (start, end) = (index * self.block_size, (index + 1) * self.block_size);
        let contents = block_contents(self.format, &self.model_name, &hash, layers, start, end, now())?;
        self.finish(index, &hash, path, &contents.tensors, &contents.metadata)
    }

    /// Write block `index` from per-layer views (already at the block's end boundary).
    pub fn write_views(&self, index: usize, views: &[LayerView<'_>]) -> Result<Written> {
        let (hash, path, existing) = self.target(index)?;
        if let Some(w) = existing {
            return Ok(w);
        }
        let c = contents(self.format, &self.model_name, &hash, self.block_size, views, now())?;
        self.finish(index, &hash, path, &c.tensors, &c.metadata)
    }

    /// Write the block a received segment carries (the decode host's path).
    pub fn write_segment(&self, seg: &Segment) -> Result<Written> {
        let index = seg.header.index as usize;
        let (start, end) = (index * self.block_size, (index + 1) * self.block_size);
        if (seg.header.start, seg.header.end) != (start as u64, end as u64) {
            return Err(CoreError::wire(format!(
                "segment {index} covers [{}, {}), block {index} is [{start}, {end})",
                seg.header.start, seg.header.end
            )));
        }
        let (hash, path, existing) = self.target(index)?;
        if let Some(w) = existing {
            return Ok(w);
        }
        self.check_segment(seg)?;
        let views: Vec<LayerView<'_>> = seg.views()?;
        let c = contents(self.format, &self.model_name, &hash, self.block_size, &views, now())?;
        self.finish(index, &hash, path, &c.tensors, &c.metadata)
    }

    /// A segment computed for another oMLX block format must not be written as this one.
    pub fn check_segment(&self, seg: &Segment) -> Result<()> {
        if seg.header.omlx_format != self.format.name() {
            return Err(CoreError::wire(format!(
                "segment {} was computed for oMLX block format {:?}, this decode host writes {:?}",
                seg.header.index, seg.header.omlx_format, self.format.name()
            )));
        }
        Ok(())
    }

    fn target(&self, index: usize) -> Result<(ChainHash, PathBuf, Option<Written>)> {
        let hash = *self.chain.get(index).ok_or_else(|| CoreError::input(0, format!("block {index} is not a full block of this prompt ({} blocks)", self.chain.len())))?;
        let path = block_path(&self.cache_dir, &hash);
        // Blocks are immutable once named: an existing (or in-flight) one is never rewritten.
        let in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|(p, _)| *p == path);
        let existing = if in_flight {
            Some(Written { path: path.clone(), bytes: 0, existed: true })
        } else {
            std::fs::metadata(&path).ok().map(|m| Written { path: path.clone(), bytes: m.len(), existed: true })
        };
        Ok((hash, path, existing))
    }

    fn finish(&self, index: usize, hash: &ChainHash, path: PathBuf, tensors: &[Tensor<'_>], metadata: &[(String, String)]) -> Result<Written> {
        let pending = write_pending(&path, tensors, metadata)?;
        let mut slot = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        // Only one block in flight: the previous one must be on disk first, in chain order.
        if let Some((_, previous)) = slot.take() {
            if let Err(e) = previous.join().unwrap_or_else(|_| Err(CoreError::wire("block flush thread panicked"))) {
                pending.discard();
                return Err(e);
            }
        }
        let bytes = pending.size();
        *slot = Some((path.clone(), std::thread::spawn(move || pending.commit())));
        tracing::debug!(block = index, hash = %hash.hex(), bytes, "block written");
        Ok(Written { path, bytes, existed: false })
    }

    /// Wait until every written block is flushed and renamed into place (visible to oMLX).
    pub fn flush(&self) -> Result<()> {
        let handle = self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).take();
        match handle {
            Some((_, h)) => h.join().unwrap_or_else(|_| Err(CoreError::wire("block flush thread panicked"))).map(|_| ()),
            None => Ok(()),
        }
    }
}

impl Drop for BlockWriter {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "last block could not be flushed");
        }
    }
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}
