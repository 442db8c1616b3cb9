//! The block file: a safetensors file laid out byte for byte as oMLX's own writer lays it out
//! (`_write_safetensors_no_mx`): u64 LE header length, the header as compact JSON with tensors
//! in insertion order and `__metadata__` last, space-padded to 8 bytes, then the tensor bytes.
//!
//! Files are written under a temporary name that does not end in `.safetensors` (oMLX's scan
//! globs `*.safetensors`), flushed to disk, then renamed into place: a partial block is never
//! visible under a block's name.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use half::bf16;

use super::pyjson::{Json, COMPACT};
use crate::error::{CoreError, Result};

/// A tensor's bytes, borrowed from the state that holds them: the writer streams them to disk
/// without copying the state.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData<'a> {
    Bf16(&'a [bf16]),
    /// The `(1,)` float32 zero.
    ZeroF32,
    /// Two little-endian i64 (a pooled-row range).
    I64Pair([i64; 2]),
}

impl TensorData<'_> {
    pub fn len_bytes(&self) -> usize {
        match self {
            TensorData::Bf16(v) => v.len() * 2,
            TensorData::ZeroF32 => 4,
            TensorData::I64Pair(_) => 16,
        }
    }

    fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        match self {
            TensorData::ZeroF32 => w.write_all(&[0; 4]),
            TensorData::I64Pair([a, b]) => {
                w.write_all(&a.to_le_bytes())?;
                w.write_all(&b.to_le_bytes())
            }
            TensorData::Bf16(v) => {
                let mut buf = [0u8; 8192];
                for chunk in v.chunks(buf.len() / 2) {
                    for (dst, x) in buf.chunks_exact_mut(2).zip(chunk) {
                        dst.copy_from_slice(&x.to_le_bytes());
                    }
                    w.write_all(&buf[..chunk.len() * 2])?;
                }
                Ok(())
            }
        }
    }
}

/// One tensor of a block: its safetensors dtype string, shape and data.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor<'a> {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub data: TensorData<'a>,
}

impl Tensor<'_> {
    /// The `(1,)` float32 zero oMLX stores for placeholders, `None` and zero-size states.
    pub fn zero_f32(name: String) -> Tensor<'static> {
        Tensor { name, dtype: "F32", shape: vec![1], data: TensorData::ZeroF32 }
    }
}

/// The header bytes (length prefix included) for these tensors and metadata.
pub fn header(tensors: &[Tensor], metadata: &[(String, String)]) -> Vec<u8> {
    let mut entries = Vec::with_capacity(tensors.len() + 1);
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + t.data.len_bytes();
        entries.push((
            t.name.clone(),
            Json::Obj(vec![
                ("dtype".into(), Json::str(t.dtype)),
                ("shape".into(), Json::List(t.shape.iter().map(|&d| Json::Int(d as i64)).collect())),
                ("data_offsets".into(), Json::List(vec![Json::Int(offset as i64), Json::Int(end as i64)])),
            ]),
        ));
        offset = end;
    }
    if !metadata.is_empty() {
        entries.push(("__metadata__".into(), Json::Obj(metadata.iter().map(|(k, v)| (k.clone(), Json::str(v.clone()))).collect())));
    }
    let mut json = Json::Obj(entries).dumps(COMPACT).into_bytes();
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

/// A block written under its temporary name, not yet flushed or visible.
#[derive(Debug)]
pub struct PendingBlock {
    file: File,
    tmp: PathBuf,
    path: PathBuf,
    size: u64,
}

impl PendingBlock {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Flush the file to disk, rename it into place, flush the directory. Returns the size.
    pub fn commit(self) -> Result<u64> {
        let PendingBlock { file, tmp, path, size } = self;
        let result = (|| -> std::io::Result<()> {
            file.sync_all()?;
            // The file (and its lock) is closed only after the rename: an unlocked temp file
            // is one a sweep may remove.
            std::fs::rename(&tmp, &path)?;
            if let Some(dir) = path.parent() {
                if let Ok(d) = File::open(dir) {
                    let _ = d.sync_all();
                }
            }
            Ok(())
        })();
        let out = result.map(|_| size).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            CoreError::io(&path, e)
        });
        drop(file);
        track(&tmp, false);
        out
    }

    /// Give up: remove the temporary file.
    pub fn discard(self) {
        let _ = std::fs::remove_file(&self.tmp);
        track(&self.tmp, false);
    }
}

/// Temporary names of blocks being written by this process (a concurrent writer's temp file
/// must never be swept as stale).
fn in_flight() -> &'static std::sync::Mutex<std::collections::HashSet<PathBuf>> {
    static SET: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<PathBuf>>> = std::sync::OnceLock::new();
    SET.get_or_init(Default::default)
}

fn track(tmp: &Path, on: bool) {
    let mut set = in_flight().lock().unwrap_or_else(|p| p.into_inner());
    if on {
        set.insert(tmp.to_path_buf());
    } else {
        set.remove(tmp);
    }
}

/// The writer's temporary name for a block: `.<hash>.<pid>.<n>.pd-tmp` (hidden, and not
/// `*.safetensors`, so oMLX's scan never sees it).
fn temp_name(stem: &str, pid: u32, n: u64) -> String {
    format!(".{stem}.{pid}.{n}.pd-tmp")
}

/// The writer's pid, when `name` is one of the writer's temporary names.
pub fn temp_owner(name: &str) -> Option<u32> {
    let inner = name.strip_prefix('.')?.strip_suffix(".pd-tmp")?;
    let mut parts = inner.split('.');
    let (stem, pid, n) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || stem.is_empty() || !stem.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return None;
    }
    n.parse::<u64>().ok()?;
    pid.parse().ok()
}

fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// A dead writer's temp file younger than this is left alone when its writer's lock cannot be
/// checked: its pid may belong to another pid namespace sharing the directory, where the writer
/// is alive.
const DEAD_OWNER_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

/// An unlocked temp file younger than this is left alone: its writer may be between creating it
/// and locking it (see [`writer_lock`]).
const UNLOCKED_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether a writer holds the lock on a temp file.
enum Lock {
    /// A live process (in any pid namespace) holds it: the file is being written.
    Held,
    /// Nobody held it: its writer closed it or died (a process's death releases its locks). The
    /// file holds the lock now, until it is dropped.
    Free(#[allow(dead_code)] File),
    /// Not checked (cannot open it, not a regular file, no `flock` on this file system).
    Unknown,
}

/// Every writer holds `flock(LOCK_EX)` on its temp file from creating it until it is renamed
/// into place or removed. The lock, unlike the pid in the name, proves a writer alive across pid
/// namespaces, and the kernel drops it when the writer dies (SIGKILL included): so a killed
/// writer's file can go at once instead of after [`DEAD_OWNER_GRACE`].
fn writer_lock(path: &Path, lstat: &std::fs::Metadata) -> Lock {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    use std::os::unix::io::AsRawFd;
    if !lstat.file_type().is_file() {
        return Lock::Unknown;
    }
    // O_NOFOLLOW: never through a link swapped in; O_NONBLOCK: never wait on a FIFO.
    let Ok(f) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC).open(path) else {
        return Lock::Unknown;
    };
    match f.metadata() {
        Ok(m) if m.file_type().is_file() && m.ino() == lstat.ino() && m.dev() == lstat.dev() => {}
        _ => return Lock::Unknown,
    }
    // SAFETY: flock on an fd this function owns; closing `f` releases what it takes.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        Lock::Free(f)
    } else if std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK) {
        Lock::Held
    } else {
        Lock::Unknown
    }
}

/// Remove the block writer's temporary files that a crashed writer left in `cache_dir`'s block
/// subdirectories: only names of the writer's own pattern, never one this process is writing nor
/// one whose writer's lock is held; one no writer holds (older than a couple of seconds), or,
/// where the lock cannot be checked, one whose writing process is gone (and older than a
/// minute); and any older than `max_age`. Returns what was removed (each logged).
pub fn clean_stale_temps(cache_dir: &Path, max_age: std::time::Duration) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let Ok(subdirs) = std::fs::read_dir(cache_dir) else { return removed };
    let now = std::time::SystemTime::now();
    for sub in subdirs.flatten() {
        let name = sub.file_name();
        let Some(n) = name.to_str() else { continue };
        // oMLX's block subdirectories only; never through a link.
        if n.len() != 1 || !n.bytes().all(|b| b.is_ascii_hexdigit()) || !sub.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(sub.path()) else { continue };
        for e in entries.flatten() {
            let fname = e.file_name();
            let Some(owner) = fname.to_str().and_then(temp_owner) else { continue };
            let path = e.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
            if meta.is_dir() || in_flight().lock().unwrap_or_else(|p| p.into_inner()).contains(&path) {
                continue;
            }
            let age = meta.modified().ok().and_then(|m| now.duration_since(m).ok()).unwrap_or_default();
            // Our own pid here is a previous process's (a restart that reused it): not in flight.
            let ours = owner == std::process::id();
            // Held until the removal, so no writer can take it in between.
            let lock = if age > max_age { Lock::Unknown } else { writer_lock(&path, &meta) };
            let why = if age > max_age {
                format!("older than {}s", max_age.as_secs())
            } else {
                match &lock {
                    Lock::Held => continue,
                    Lock::Free(_) if ours || age >= UNLOCKED_GRACE => format!("no writer holds its lock (pid {owner} in its name)"),
                    Lock::Free(_) => continue,
                    Lock::Unknown if ours || (age > DEAD_OWNER_GRACE && !process_alive(owner)) => format!("its writer (pid {owner}) is gone"),
                    Lock::Unknown => continue,
                }
            };
            if std::fs::remove_file(&path).is_ok() {
                tracing::info!(file = %path.display(), reason = %why, "removed a stale block temp file");
                removed.push(path);
            }
            drop(lock);
        }
    }
    removed
}

/// Write a block under a temporary name in its final directory (a name oMLX's scan ignores).
pub fn write_pending(path: &Path, tensors: &[Tensor<'_>], metadata: &[(String, String)]) -> Result<PendingBlock> {
    let dir = path.parent().ok_or_else(|| CoreError::io(path, std::io::Error::other("block path has no directory")))?;
    std::fs::create_dir_all(dir).map_err(|e| CoreError::io(dir, e))?;
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("block");
    // Unique per writer: two requests with the same prompt may write the same block at once.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp: PathBuf = dir.join(temp_name(stem, std::process::id(), n));
    track(&tmp, true);
    let result = (|| -> std::io::Result<(File, u64)> {
        // create_new: never write through a link or a file someone planted on the temp name.
        let file = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        // Held until the rename or removal (the file stays open in the pending block): a sweep
        // in any process keeps a locked temp file, and a writer's death releases the lock. Best
        // effort: without flock here, a sweep falls back to the pid in the name.
        // SAFETY: flock on the fd `file` owns.
        unsafe { libc::flock(std::os::unix::io::AsRawFd::as_raw_fd(&file), libc::LOCK_EX) };
        let mut w = BufWriter::with_capacity(1 << 20, file);
        let head = header(tensors, metadata);
        w.write_all(&head)?;
        let mut size = head.len() as u64;
        for t in tensors {
            t.data.write_to(&mut w)?;
            size += t.data.len_bytes() as u64;
        }
        Ok((w.into_inner().map_err(|e| e.into_error())?, size))
    })();
    match result {
        Ok((file, size)) => Ok(PendingBlock { file, tmp, path: path.to_path_buf(), size }),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            track(&tmp, false);
            Err(CoreError::io(path, e))
        }
    }
}

/// Write a block file atomically: temp file in the same directory, fsync, rename, fsync the
/// directory. Returns the file size.
pub fn write_atomic(path: &Path, tensors: &[Tensor<'_>], metadata: &[(String, String)]) -> Result<u64> {
    write_pending(path, tensors, metadata)?.commit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout_matches_omlx() {
        let t = vec![
            Tensor { name: "layer_0_state_0".into(), dtype: "BF16", shape: vec![1, 1, 2, 2], data: TensorData::Bf16(&[bf16::ZERO; 4]) },
            Tensor::zero_f32("layer_0_state_1".into()),
        ];
        let meta = vec![("block_hash".to_string(), "ab".to_string()), ("token_count".to_string(), "2".to_string())];
        let h = header(&t, &meta);
        let len = u64::from_le_bytes(h[..8].try_into().unwrap()) as usize;
        assert_eq!(len % 8, 0);
        assert_eq!(h.len(), 8 + len);
        let text = std::str::from_utf8(&h[8..]).unwrap().trim_end();
        assert_eq!(
            text,
            r#"{"layer_0_state_0":{"dtype":"BF16","shape":[1,1,2,2],"data_offsets":[0,8]},"layer_0_state_1":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},"__metadata__":{"block_hash":"ab","token_count":"2"}}"#
        );
    }

    #[test]
    fn atomic_write_leaves_no_temp_file() {
        let dir = std::env::temp_dir().join(format!("pd-bridge-file-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let p = dir.join("a").join("abc.safetensors");
        let size = write_atomic(&p, &[Tensor::zero_f32("x".into())], &[("k".into(), "v".into())]).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), size);
        let names: Vec<_> = std::fs::read_dir(p.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("abc.safetensors")]);
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.names(), vec!["x"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
