//! The prefill host's shared counts under shuttle's schedules: every interleaving of push, pull,
//! close, evict, expire and seal that the schedulers reach (exhaustively for the small scenario
//! of issue 20's race), not only the ones a busy or idle machine happens to run.
//!
//! Run with `cargo test -p pd-bridge-core --release --features model-check --test outbox_model`
//! (the test command does): the feature swaps the segment server's locks and counters for
//! shuttle's. A credit of bytes never charged panics under the feature, so the schedulers report
//! the exact schedule that drove a count below zero.
#![cfg(feature = "model-check")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_bridge_core::segment::Segment;
use pd_bridge_core::segment_server::{ConnectionSlots, Outbox, Outboxes, ServerConfig};
use pd_bridge_core::wire::{self, CaptureKey, CaptureSecret, PromptDigest, Seal};
use shuttle::thread;

fn key(id: &str) -> CaptureKey {
    let secret = CaptureSecret::from_hex(&"ab".repeat(32)).unwrap();
    CaptureKey::derive(b"tok", &secret, id, "fp", &PromptDigest::of(&[1, 2, 3])).unwrap()
}

fn segs(n: usize) -> Vec<Segment> {
    wire::fuzz::segments(n, 8)
}

fn seg_bytes() -> u64 {
    wire::segment_payload_len(&segs(1)[0])
}

fn config(memory_bound: u64) -> ServerConfig {
    ServerConfig {
        idle: Duration::from_secs(3600),
        grace: Duration::from_secs(30),
        pull_timeout: Duration::from_secs(120),
        memory_bound,
        ..ServerConfig::default()
    }
}

/// What a pulling decode host does with an outbox: claim it, take segments until the seal or a
/// close. Returns the segment indices it got and whether the seal came.
fn pull(outbox: &Outbox) -> (Vec<u32>, Option<Seal>) {
    let mut got = vec![];
    loop {
        match outbox.next(Duration::from_secs(3600)) {
            Some(Ok(seg)) => got.push(seg.header.index),
            Some(Err(seal)) => return (got, Some(seal)),
            None => return (got, None),
        }
    }
}

fn complete(n: usize) -> Seal {
    Seal::Complete { blocks: n as u32, tokens: 4 * n as u64 }
}

/// The outbox's own accounting and the server's agree once every thread is done.
fn assert_balanced(outboxes: &Outboxes, all: &[&Arc<Outbox>]) {
    let memory = outboxes.memory();
    assert_eq!(memory.faults(), 0, "a credit found fewer bytes than it returned");
    let held: u64 = all.iter().map(|o| o.queued_bytes()).sum();
    assert_eq!(memory.used(), held, "server count vs the outboxes' queues");
}

/// Issue 20's race, exhaustively for one segment: capture A pushes while A's reader pops. Under
/// the old order (queue, wake the reader, unlock, then count) a pop between the unlock and the
/// count credited bytes never charged; here that credit panics, so every schedule is checked.
#[test]
fn a_reader_popping_while_its_capture_pushes_never_miscounts() {
    shuttle::check_dfs(|| reader_and_capture(false), None);
}

/// The same with capture B pushing beside them, under a bound far above what they hold: B must
/// stay open (with the old order the wrapped count made it close itself "memory bound full").
/// Too many schedules for an exhaustive search: PCT and random schedules.
#[test]
fn a_capture_beside_a_read_one_is_never_closed_by_its_count() {
    shuttle::check_pct(|| reader_and_capture(true), 20_000, 3);
    shuttle::check_random(|| reader_and_capture(true), 5_000);
}

fn reader_and_capture(with_b: bool) {
    let outboxes = Outboxes::new(config(1 << 30));
    let a = outboxes.register("a", key("a"));
    let b = outboxes.register("b", key("b"));
    let seg = segs(1).remove(0);
    let reader = {
        let a = a.clone();
        thread::spawn(move || {
            assert!(a.claim());
            pull(&a)
        })
    };
    let capture_a = {
        let a = a.clone();
        thread::spawn(move || {
            assert!(a.push(seg), "a healthy capture was closed: {:?}", a.closed_reason());
            a.seal(complete(1));
        })
    };
    let pushed_b = with_b.then(|| b.push(segs(1).remove(0)));
    capture_a.join().unwrap();
    let (got, seal) = reader.join().unwrap();
    assert_eq!(got, vec![0]);
    assert_eq!(seal, Some(complete(1)));
    assert_ne!(pushed_b, Some(false), "a healthy capture beside a read one was closed: {:?}", b.closed_reason());
    assert_balanced(&outboxes, &[&a, &b]);
    assert_eq!(outboxes.memory().used(), if with_b { seg_bytes() } else { 0 }, "only B's segment is held");
}

/// Everything at once under a bound of three segments: a pulled capture and its reader, an
/// unpulled capture (the eviction candidate), a fast capture that overruns the bound, the sweep
/// expiring whatever nobody pulled, and a reader that leaves. Whatever the schedule: the counts
/// balance, no pulled stream is evicted, every close says why, and once every outbox is closed
/// the server holds nothing.
fn everything_at_once() {
    let bytes = seg_bytes();
    let outboxes = Outboxes::new(config(3 * bytes));
    let pulled = outboxes.register("pulled", key("pulled"));
    let idle = outboxes.register("idle", key("idle"));
    let burst = outboxes.register("burst", key("burst"));
    let leaving = outboxes.register("leaving", key("leaving"));
    assert!(pulled.claim() && leaving.claim());

    let reader = {
        let p = pulled.clone();
        thread::spawn(move || pull(&p))
    };
    let capture = {
        let p = pulled.clone();
        thread::spawn(move || {
            let mut pushed = 0;
            for s in segs(3) {
                if !p.push(s) {
                    break;
                }
                pushed += 1;
            }
            p.seal(complete(pushed));
            pushed
        })
    };
    let idle_capture = {
        let i = idle.clone();
        thread::spawn(move || {
            for s in segs(2) {
                if !i.push(s) {
                    break;
                }
            }
            i.seal(complete(2));
        })
    };
    let burst_capture = {
        let b = burst.clone();
        thread::spawn(move || segs(4).into_iter().take_while(|s| b.push(s.clone())).count())
    };
    let leaver = {
        let l = leaving.clone();
        thread::spawn(move || {
            l.push(segs(1).remove(0));
            l.close("the decode host went away".into());
        })
    };
    let sweeper = {
        let o = outboxes.clone();
        thread::spawn(move || o.sweep(Instant::now() + Duration::from_secs(3600)))
    };

    let pushed = capture.join().unwrap();
    idle_capture.join().unwrap();
    let burst_pushed = burst_capture.join().unwrap();
    leaver.join().unwrap();
    sweeper.join().unwrap();
    let (got, seal) = reader.join().unwrap();

    // The pulled stream is never evicted or expired: what its capture pushed arrives in order,
    // then its seal — unless its own push overran the bound while other pulled streams held it,
    // which closes it with that reason.
    match pulled.closed_reason() {
        None => {
            assert_eq!(got, (0..pushed as u32).collect::<Vec<_>>());
            assert_eq!(seal, Some(complete(pushed)));
        }
        Some(why) => assert!(why.contains("not reading fast enough"), "{why}"),
    }
    for (o, ok) in [(&idle, &["dropped unpulled", "not pulled within", "sealed but not pulled"][..]), (&burst, &["dropped unpulled", "not pulled within"][..])] {
        if let Some(why) = o.closed_reason() {
            assert!(ok.iter().any(|k| why.contains(k)), "{}: {why}", o.request_id());
        }
    }
    assert!(burst_pushed <= 4);
    // Its own push may have overrun the bound first (the first reason stays).
    let why = leaving.closed_reason().unwrap();
    assert!(why == "the decode host went away" || why.contains("not reading fast enough"), "{why}");
    assert_balanced(&outboxes, &[&pulled, &idle, &burst, &leaving]);
    assert!(outboxes.memory().used() <= 3 * bytes + bytes, "held {} past the bound and one segment", outboxes.memory().used());

    outboxes.shut_down();
    assert_eq!(outboxes.memory().used(), 0, "the server holds nothing once every outbox is closed");
    assert_eq!(outboxes.memory().faults(), 0);
}

#[test]
fn push_pull_close_evict_expire_and_seal_in_any_order_keep_the_counts() {
    // A loaded run's PCT once found an unpulled capture closing itself saying its decode host
    // was "not reading fast enough" (nobody was reading it; another push had charged between
    // its eviction and its check). Schedules do not replay across code changes: search wide.
    shuttle::check_pct(everything_at_once, 10_000, 3);
    shuttle::check_pct(everything_at_once, 5_000, 5);
    shuttle::check_random(everything_at_once, 10_000);
}

/// Connection slots: never more open than the cap, even for a moment, and all back at the end.
#[test]
fn connection_slots_never_pass_their_cap() {
    shuttle::check_dfs(
        || {
            let slots = ConnectionSlots::new(1);
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let s = slots.clone();
                    thread::spawn(move || {
                        let held = s.try_acquire();
                        assert!(s.open() <= s.cap(), "{} open, cap {}", s.open(), s.cap());
                        held.is_ok()
                    })
                })
                .collect();
            let admitted = threads.into_iter().map(|t| t.join().unwrap()).filter(|&ok| ok).count();
            assert!((1..=2).contains(&admitted), "{admitted}");
            assert_eq!(slots.open(), 0);
        },
        None,
    );
}

/// One capture pulled over two lanes while it pushes: whatever the schedule, each lane gets
/// exactly its own segments in order and the seal, exactly one lane finds itself the last to
/// send it, and the memory count balances to zero.
#[test]
fn two_lanes_split_a_capture_and_exactly_one_retires_it() {
    shuttle::check_pct(two_lanes, 20_000, 3);
    shuttle::check_random(two_lanes, 5_000);
}

fn two_lanes() {
    let outboxes = Outboxes::new(config(1 << 30));
    let o = outboxes.register("laned", key("laned"));
    let lanes = wire::Lane::all(2).unwrap();
    let readers: Vec<_> = lanes
        .iter()
        .map(|&lane| {
            let o = o.clone();
            thread::spawn(move || {
                o.claim_lane(lane).unwrap();
                let mut got = vec![];
                loop {
                    match o.next_on(lane, Duration::from_secs(3600)) {
                        Some(Ok(seg)) => got.push(seg.header.index),
                        Some(Err(seal)) => return (got, seal, o.lane_sent(lane)),
                        None => panic!("lane {lane:?} closed: {:?}", o.closed_reason()),
                    }
                }
            })
        })
        .collect();
    let capture = {
        let o = o.clone();
        thread::spawn(move || {
            for s in segs(3) {
                assert!(o.push(s), "closed: {:?}", o.closed_reason());
            }
            o.seal(complete(3));
        })
    };
    capture.join().unwrap();
    let got: Vec<_> = readers.into_iter().map(|r| r.join().unwrap()).collect();
    assert_eq!(got[0].0, vec![0, 2]);
    assert_eq!(got[1].0, vec![1]);
    assert!(got.iter().all(|g| g.1 == complete(3)));
    assert_eq!(got.iter().filter(|g| g.2).count(), 1, "exactly one lane retires the outbox");
    assert_balanced(&outboxes, &[&o]);
    assert_eq!(outboxes.memory().used(), 0);
}
