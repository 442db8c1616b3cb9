//! The block writer: one request's full blocks, written into an oMLX cache directory as the
//! pooler reaches each block boundary. Memory is one block at a time, whatever the prompt length.
//!
//! It is the one way received segments become blocks: [`BlockWriter::check_segment`] admits
//! each segment of a stream (block grid, order, layer count, every array's shape as the
//! decoder's plan and the format dictate, pool deltas contiguous, every value finite) before
//! anything of it is written, and [`BlockWriter::write_segment`] admits and writes. A file
//! already on a block's name is validated first; a bad one is moved aside and the block written.
//! Creating the first writer for a cache directory removes temp files a crashed writer left.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::assembler::Assembler;
use super::chain::{chain, ChainHash};
use super::file::{clean_stale_temps, write_pending, Tensor};
use super::layout::{block_contents, contents};
use super::spec::StoreSpec;
use super::validate::{inspect_with, move_aside, BlockInfo, Expect, RejectKind, Rejection};
use crate::error::{CoreError, Result};
use crate::format::OmlxFormat;
use crate::family;
use crate::plan::ModelPlan;
use crate::pooler::LayerState;
use crate::segment::Segment;
use crate::view::LayerView;

/// A temp file this old has no writer, whatever its name or its lock says (a block is written in
/// seconds; a lock a forked child inherited could outlive the writer).
pub const STALE_TEMP_AGE: Duration = Duration::from_secs(600);

/// Cache directories this process has swept for stale temp files.
fn swept() -> &'static Mutex<HashSet<PathBuf>> {
    static SET: std::sync::OnceLock<Mutex<HashSet<PathBuf>>> = std::sync::OnceLock::new();
    SET.get_or_init(Default::default)
}

/// Where a stream of segments stands: the next block it may carry and the pool rows so far.
struct StreamState {
    /// The geometry segments are checked against: the plan's, else the first segment's.
    spec: Option<StoreSpec>,
    next: u64,
    pool_rows: Vec<Vec<u64>>,
    /// Accumulated pools for [`BlockWriter::write_segment`] (full-pool formats).
    asm: Assembler,
}

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
    /// The existing file's validation, when the writer validated it to keep it.
    checked: Option<BlockInfo>,
}

/// One block on disk under its final name, validated once: what the decode host needs to put
/// it into oMLX's index without reading or checking it again ([`BlockWriter::landed`]).
#[derive(Debug, Clone)]
pub struct Landed {
    pub index: usize,
    pub hash: ChainHash,
    pub path: PathBuf,
    /// Already on disk before this writer (left as it was), or written by it.
    pub existed: bool,
    /// The validator's verdict on the file as it lies under its final name, against the
    /// writer's format, model name, block size, cache directory and plan (when it has one).
    pub check: std::result::Result<BlockInfo, Rejection>,
}

pub struct BlockWriter {
    format: OmlxFormat,
    cache_dir: PathBuf,
    model_name: String,
    block_size: usize,
    chain: Vec<ChainHash>,
    /// The decoder's plan: segments and files on block names are checked against it.
    plan: Option<ModelPlan>,
    stream: Mutex<StreamState>,
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
        let cache_dir: PathBuf = cache_dir.into();
        let first = swept().lock().unwrap_or_else(|p| p.into_inner()).insert(cache_dir.clone());
        if first {
            clean_stale_temps(&cache_dir, STALE_TEMP_AGE);
        }
        let stream = StreamState { spec: None, next: 0, pool_rows: Vec::new(), asm: Assembler::for_layout(format.pool_layout()) };
        Ok(BlockWriter { format, cache_dir, model_name, block_size, chain, plan: None, stream: Mutex::new(stream), in_flight: Mutex::new(None) })
    }

    /// Check every segment and every file already on a block's name against the decoder's
    /// plan (its layer count, every array's shape), not only against the first segment.
    pub fn with_plan(mut self, plan: &ModelPlan) -> Result<Self> {
        let spec = StoreSpec::new(plan, self.format, self.block_size)?;
        let st = self.stream.get_mut().unwrap_or_else(|p| p.into_inner());
        st.pool_rows = spec.no_pool_rows();
        st.spec = Some(spec);
        self.plan = Some(plan.clone());
        Ok(self)
    }

    /// Continue this request's stream at the block boundary `carry.position` (multi-turn): the
    /// decoder holds the blocks before it, the prefill host resumed its capture from the same
    /// carry state, so the next segment is block `S / block_size` and its pool deltas start at
    /// the carried rows. Refused (nothing changes) once a segment was admitted, or for a carry
    /// state of another format, block size or prefix (its chain hash must be this prompt's block
    /// ending at `S`), or past the prompt's full blocks. Delta-pool formats only (upstream).
    pub fn resume_at(&self, carry: &crate::pooler::carry::CarryState) -> Result<()> {
        use crate::error::CarryField;
        let refuse = |what: CarryField, reason: String| Err(CoreError::Carry { what, reason });
        let mut st = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        if st.next != 0 {
            return Err(CoreError::input(0, format!("{} segments were already admitted; only a fresh stream resumes", st.next)));
        }
        if carry.format != self.format {
            return refuse(CarryField::Format, format!("made for {:?}, this writer writes {:?}", carry.format.name(), self.format.name()));
        }
        if carry.block_size != self.block_size {
            return refuse(CarryField::BlockSize, format!("made for {}-token blocks, this writer's are {}", carry.block_size, self.block_size));
        }
        let s = carry.position;
        if s == 0 || s % self.block_size != 0 || s / self.block_size > self.chain.len() {
            return refuse(CarryField::Position, format!("resume point {s} is not a block boundary within this prompt's {} blocks", self.chain.len()));
        }
        let ours = self.chain[s / self.block_size - 1];
        if let Some(theirs) = carry.chain_hash.filter(|h| *h != ours) {
            return refuse(CarryField::Prefix, format!("taken at the end of block {}, this prompt's block ending at {s} is {}", theirs.hex(), ours.hex()));
        }
        if let Some(plan) = &self.plan {
            carry.check(&family::geometry(plan, self.format, self.block_size))?;
        }
        let rows = carry.pool_rows();
        st.asm = Assembler::resuming(self.format.pool_layout(), &rows)?;
        st.pool_rows = rows;
        st.next = (s / self.block_size) as u64;
        Ok(())
    }

    /// The block the stream's next segment must carry (0, or where it resumed, plus those admitted).
    pub fn next_block(&self) -> usize {
        self.stream.lock().unwrap_or_else(|p| p.into_inner()).next as usize
    }

    pub fn plan(&self) -> Option<&ModelPlan> {
        self.plan.as_ref()
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

    /// Admit and write the block a received segment carries (the decode host's path): the
    /// segment is checked as [`Self::check_segment`] does before anything is written.
    pub fn write_segment(&self, seg: &Segment) -> Result<Written> {
        let mut st = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        self.admit(&mut st, seg)?;
        st.asm.absorb(seg)?;
        let index = seg.header.index as usize;
        let (hash, path, existing) = self.target(index)?;
        if let Some(w) = existing {
            return Ok(w);
        }
        let views: Vec<LayerView<'_>> = st.asm.views(seg)?;
        let c = contents(self.format, &self.model_name, &hash, self.block_size, &views, now())?;
        self.finish(index, &hash, path, &c.tensors, &c.metadata)
    }

    /// Admit a received segment as its stream's next, before anything of it is written: it must
    /// carry the next block of this prompt (streams start at block 0, in order), cover exactly
    /// that block, be computed for this oMLX block format, have the decoder's layer count and
    /// every array in the shape the plan (without one: the stream's first segment) and the
    /// format give at that block, pool deltas starting where the previous segment's ended,
    /// and only finite values. Each refusal is a [`CoreError::Segment`] naming the block, the
    /// layer and array, and what was wrong; a refused segment changes nothing.
    pub fn check_segment(&self, seg: &Segment) -> Result<()> {
        let mut st = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        self.admit(&mut st, seg)
    }

    fn admit(&self, st: &mut StreamState, seg: &Segment) -> Result<()> {
        let block = seg.header.index as u64;
        if seg.header.omlx_format != self.format.name() {
            return Err(CoreError::segment(
                block,
                None,
                None,
                format!("segment {} was computed for oMLX block format {:?}, this decode host writes {:?}", seg.header.index, seg.header.omlx_format, self.format.name()),
            ));
        }
        if seg.header.first_layer != 0 {
            return Err(CoreError::segment(
                block,
                None,
                None,
                format!(
                    "segment {} holds the model's layers from {} on: one pipeline stage's part of a block, not a whole block (the prefill host runs pipeline parallelism: set PD_BRIDGE_PREFILL_PP on the decode host)",
                    seg.header.index, seg.header.first_layer
                ),
            ));
        }
        if block as usize >= self.chain.len() {
            return Err(CoreError::segment(block, None, None, format!("not a full block of this prompt ({} blocks)", self.chain.len())));
        }
        let inferred;
        let spec = match &st.spec {
            Some(s) => s,
            None => {
                inferred = StoreSpec::infer(seg, self.format, self.block_size)?;
                &inferred
            }
        };
        let rows = if st.pool_rows.is_empty() { spec.no_pool_rows() } else { st.pool_rows.clone() };
        let after = spec.check_segment(seg, st.next, &rows)?;
        if st.spec.is_none() {
            st.spec = Some(StoreSpec::infer(seg, self.format, self.block_size)?);
        }
        st.pool_rows = after;
        st.next += 1;
        Ok(())
    }

    fn target(&self, index: usize) -> Result<(ChainHash, PathBuf, Option<Written>)> {
        let hash = *self.chain.get(index).ok_or_else(|| CoreError::input(0, format!("block {index} is not a full block of this prompt ({} blocks)", self.chain.len())))?;
        let path = block_path(&self.cache_dir, &hash);
        // Blocks are immutable once named: an existing (or in-flight) one is never rewritten.
        let in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|(p, _)| *p == path);
        if in_flight {
            return Ok((hash, path.clone(), Some(Written { path, bytes: 0, existed: true, checked: None })));
        }
        // A linked block subdirectory would put the block (and what is read back) elsewhere.
        if let (Some(dir), Ok(cache)) = (path.parent(), std::fs::canonicalize(&self.cache_dir)) {
            if let Ok(real) = std::fs::canonicalize(dir) {
                if real != cache.join(&hash.hex()[..1]) {
                    return Err(CoreError::io(dir, std::io::Error::other(format!("block directory resolves to {}, outside the cache directory {}", real.display(), cache.display()))));
                }
            }
        }
        // lstat: a link or FIFO on the name is looked at, never followed or opened.
        if std::fs::symlink_metadata(&path).is_err() {
            return Ok((hash, path, None));
        }
        // Something is on the name: keep it only if it is this block, sound; else move it aside
        // (the name is this prompt's, so nothing else may sit there) and write the block.
        match inspect_with(&path, &self.expect(), self.plan.as_ref(), Some(&self.cache_dir)) {
            Ok(info) => Ok((hash, path.clone(), Some(Written { path, bytes: info.file_size, existed: true, checked: Some(info) }))),
            Err(why) if matches!(why.kind, RejectKind::Outside | RejectKind::Unreadable) => {
                Err(CoreError::io(&path, std::io::Error::other(format!("cannot write block {index}: {why}"))))
            }
            Err(why) => {
                move_aside(&path, &self.cache_dir, &why).map_err(|e| CoreError::io(&path, e))?;
                tracing::warn!(block = index, file = %path.display(), reason = %why, "a bad file was on the block's name; writing the block");
                Ok((hash, path, None))
            }
        }
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
        Ok(Written { path, bytes, existed: false, checked: None })
    }

    /// What a file on one of this writer's block names must be: its format, model, layer count
    /// (with a plan) and block size.
    fn expect(&self) -> Expect {
        Expect { format: self.format, model_name: Some(self.model_name.clone()), num_layers: self.plan.as_ref().map(ModelPlan::num_layers), block_size: Some(self.block_size) }
    }

    /// Block `index`, once `written` is flushed under its final name: the file validated exactly
    /// once (an existing file this writer already validated to keep it is not read again), with
    /// its path and hash. Call after [`Self::flush`]; the decode host registers the block with
    /// oMLX from this, refusing it when `check` is a rejection.
    pub fn landed(&self, index: usize, written: Written) -> Result<Landed> {
        let hash = *self.chain.get(index).ok_or_else(|| CoreError::input(0, format!("block {index} is not a full block of this prompt ({} blocks)", self.chain.len())))?;
        let check = match written.checked {
            Some(info) => Ok(info),
            None => inspect_with(&written.path, &self.expect(), self.plan.as_ref(), Some(&self.cache_dir)),
        };
        Ok(Landed { index, hash, path: written.path, existed: written.existed, check })
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
