//! The sweep of stale block temp files tells a dead writer's file from a live one's by the
//! writer's `flock` on it, not only by the pid in its name: a writer SIGKILLed mid-block leaves a
//! file that the next process's sweep removes at once (not a minute later), and a file whose lock
//! a live process holds is kept even when the pid in its name is not alive here (a writer in
//! another pid namespace sharing the cache directory).
//!
//! The other processes are this test binary run again with `PD_TEST_SWEEP_CHILD` set (the
//! `child_process` test, a no-op otherwise).

mod common;

use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use pd_bridge_core::block::file::{clean_stale_temps, temp_owner, write_pending, Tensor};
use pd_bridge_core::block::writer::STALE_TEMP_AGE;
use pd_bridge_core::block::BlockWriter;

use common::temp_dir;

const CHILD_ENV: &str = "PD_TEST_SWEEP_CHILD";

/// Held while a child is spawned. Between fork and exec a child holds a copy of every open file
/// of this process, the other tests' temp files included, and with them their `flock`s; a test
/// that checks a lock was released holds this so that no spawn shares its file meanwhile.
static SPAWN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// In a child: `write:<block path>:<marker>` writes a block under its temp name and holds it
/// pending; `hold:<file>:<marker>` opens a file and holds `flock(LOCK_EX)` on it. Either then
/// creates the marker and waits for its stdin to close (or for SIGKILL).
#[test]
fn child_process() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let mut parts = spec.splitn(3, ':');
    let (mode, target, marker) = (parts.next().unwrap(), PathBuf::from(parts.next().unwrap()), parts.next().unwrap());
    let _held: Box<dyn std::any::Any> = match mode {
        "write" => Box::new(write_pending(&target, &[Tensor::zero_f32("x".into())], &[("k".into(), "v".into())]).unwrap()),
        "hold" => {
            let f = std::fs::OpenOptions::new().read(true).open(&target).unwrap();
            assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
            Box::new(f)
        }
        other => panic!("unknown child mode {other}"),
    };
    std::fs::write(marker, b"ready").unwrap();
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
}

/// The child, killed (SIGKILL) and reaped when dropped.
struct ChildProc(Child);

impl ChildProc {
    fn start(mode: &str, target: &Path, dir: &Path) -> ChildProc {
        let marker = dir.join(format!("ready-{mode}"));
        let spawning = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
        let child = Command::new(std::env::current_exe().unwrap())
            .args(["child_process", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, format!("{mode}:{}:{}", target.display(), marker.display()))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        drop(spawning);
        let mut c = ChildProc(child);
        let t0 = Instant::now();
        while !marker.exists() {
            if let Some(st) = c.0.try_wait().unwrap() {
                panic!("child {mode} exited early: {st}");
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "child {mode} never got ready");
            std::thread::sleep(Duration::from_millis(10));
        }
        c
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    /// SIGKILL, as an OOM kill or `kill -9` of oMLX mid-write would.
    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn dead_pid() -> u32 {
    (100_000..4_000_000u32).rev().step_by(7919).find(|&p| unsafe { libc::kill(p as i32, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)).unwrap()
}

fn set_age(path: &Path, age: Duration) {
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_modified(SystemTime::now() - age).unwrap();
}

fn temps_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).unwrap().flatten().filter(|e| e.file_name().to_str().and_then(temp_owner).is_some()).map(|e| e.path()).collect()
}

fn hex() -> String {
    "a".repeat(64)
}

#[test]
fn a_sigkilled_writers_temp_file_is_removed_by_the_next_sweep_within_the_minute() {
    let dir = temp_dir("sweep-killed");
    let block = dir.join("a").join(format!("{}.safetensors", hex()));
    let mut writer = ChildProc::start("write", &block, &dir);
    let pid = writer.pid();
    let temps = temps_in(block.parent().unwrap());
    assert_eq!(temps.len(), 1, "{temps:?}");
    let tmp = &temps[0];
    assert_eq!(tmp.file_name().and_then(|n| n.to_str()).and_then(temp_owner), Some(pid));
    // Alive and writing: kept, however old the file looks (short of the hard limit).
    set_age(tmp, Duration::from_secs(120));
    assert!(clean_stale_temps(&dir, STALE_TEMP_AGE).is_empty());
    assert!(tmp.exists());

    writer.kill();
    // A restart a few seconds after the kill, well within the old one-minute grace.
    set_age(tmp, Duration::from_secs(5));
    let _w = BlockWriter::new(&dir, "m", 64, &[1, 2, 3]).unwrap();
    assert!(!tmp.exists(), "the killed writer's temp file {} was left", tmp.display());
}

#[test]
fn a_temp_file_locked_by_a_live_process_under_a_foreign_pid_is_kept() {
    let dir = temp_dir("sweep-foreign");
    let sub = dir.join("b");
    std::fs::create_dir_all(&sub).unwrap();
    // The pid in the name is not alive here: as a writer in another pid namespace would look.
    let tmp = sub.join(format!(".{}.{}.0.pd-tmp", hex(), dead_pid()));
    std::fs::write(&tmp, b"partial").unwrap();
    let mut holder = ChildProc::start("hold", &tmp, &dir);
    // Older than the dead-owner grace, younger than the hard limit: only the lock keeps it.
    set_age(&tmp, Duration::from_secs(120));
    assert!(clean_stale_temps(&dir, STALE_TEMP_AGE).is_empty());
    assert!(tmp.exists(), "a temp file whose lock a live process holds was removed");
    // Older than the hard limit: removed whatever holds it (a block is written in seconds).
    let long = sub.join(format!(".{}.{}.1.pd-tmp", hex(), dead_pid()));
    std::fs::write(&long, b"partial").unwrap();
    let mut holder2 = ChildProc::start("hold", &long, &dir);
    set_age(&long, STALE_TEMP_AGE + Duration::from_secs(60));
    assert_eq!(clean_stale_temps(&dir, STALE_TEMP_AGE), vec![long.clone()]);
    holder2.kill();

    holder.kill();
    assert_eq!(clean_stale_temps(&dir, STALE_TEMP_AGE), vec![tmp.clone()]);
}

#[test]
fn an_unlocked_temp_file_is_removed_once_past_the_create_to_lock_window() {
    let dir = temp_dir("sweep-unlocked");
    let sub = dir.join("c");
    std::fs::create_dir_all(&sub).unwrap();
    let dead = dead_pid();
    // Alive pid (init, here or in another namespace) or dead: nobody holds the lock.
    let (fresh, settled, alive_named) =
        (sub.join(format!(".{}.{dead}.0.pd-tmp", hex())), sub.join(format!(".{}.{dead}.1.pd-tmp", hex())), sub.join(format!(".{}.1.2.pd-tmp", hex())));
    for p in [&fresh, &settled, &alive_named] {
        std::fs::write(p, b"partial").unwrap();
    }
    set_age(&settled, Duration::from_secs(5));
    set_age(&alive_named, Duration::from_secs(5));
    let mut removed = clean_stale_temps(&dir, STALE_TEMP_AGE);
    removed.sort();
    let mut want = vec![settled.clone(), alive_named.clone()];
    want.sort();
    assert_eq!(removed, want);
    // Just created: its writer may not have taken the lock yet.
    assert!(fresh.exists());
}

#[test]
fn the_writer_holds_the_lock_until_the_rename() {
    let _no_spawn = SPAWN.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("sweep-own");
    let block = dir.join("d").join(format!("{}.safetensors", hex()));
    let pending = write_pending(&block, &[Tensor::zero_f32("x".into())], &[]).unwrap();
    let temps = temps_in(block.parent().unwrap());
    assert_eq!(temps.len(), 1);
    let f = std::fs::File::open(&temps[0]).unwrap();
    // flock conflicts between open files, in one process as across processes.
    assert_ne!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EWOULDBLOCK));
    // Ours and in flight: kept even past the grace.
    set_age(&temps[0], Duration::from_secs(120));
    assert!(clean_stale_temps(&dir, STALE_TEMP_AGE).is_empty());
    pending.commit().unwrap();
    assert!(block.exists() && temps_in(block.parent().unwrap()).is_empty());
    assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
}
