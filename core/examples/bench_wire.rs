//! The wire on loopback, encrypted beside clear, in one run: one stream of segments from a
//! sending thread to a reading thread over TCP, GB/s of segment payload.
//!
//! `cargo run --release -p pd-bridge-core --example bench_wire -- [total MiB] [segment MiB] [rounds]`
//! (defaults 2048, 4, 3). "clear" is the same frames over the same socket without the Noise
//! channel (the in-memory codec, buffered): the link's own ceiling on this machine. "encrypted"
//! is the real thing: the wire's handshake, then every frame in AES-GCM records. Each is timed
//! from the first byte sent to the seal read, segments decoded by the reader (as ingest does,
//! block writes aside). Then one capture over 2, 4 and 8 lanes (`BENCH_WIRE_LANES=2,4,8`): a
//! sending and a reading thread per lane, the same segments split by index.

use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use half::bf16;
use pd_bridge_core::view::{ArrayView, LayerView};
use pd_bridge_core::segment::Segment;
use pd_bridge_core::wire::secure::{self, Hello};
use pd_bridge_core::wire::{send_seal, send_segment, CaptureKey, CaptureSecret, Event, FrameLimits, Lane, PlainFrames, PromptDigest, Seal, SegmentReader};
use pd_bridge_core::OmlxFormat;

fn segments(count: usize, bytes: usize) -> Vec<Segment> {
    // 8 layers of two arrays, 576 values a row (an MLA latent + rope row): MiB-sized blocks.
    let rows = (bytes / 2 / 576 / 16).max(1);
    let data: Vec<bf16> = (0..rows * 576).map(|i| bf16::from_bits((i * 2654435761usize) as u16)).collect();
    (0..count)
        .map(|i| {
            let views: Vec<LayerView<'_>> = (0..8).map(|_| LayerView::Kv(ArrayView::new(576, &data), ArrayView::new(576, &data))).collect();
            let s = (i * rows) as u64;
            Segment::from_views(OmlxFormat::Fork070, "bench", "sha256:bench", i as u32, s, s + rows as u64, &views)
        })
        .collect()
}

/// CPU seconds this thread has used (user and system: the socket copies count).
fn thread_cpu() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

fn read_all<F: pd_bridge_core::wire::FrameSource>(mut r: SegmentReader<F>) -> u64 {
    let mut bytes = 0u64;
    loop {
        match r.next_event().expect("stream") {
            Event::Segment(s) => bytes += s.arrays.iter().map(|a| a.len() as u64 * 2).sum::<u64>(),
            Event::Seal(_) => return bytes,
        }
    }
}

/// (payload bytes, wall seconds, sender CPU seconds, reader CPU seconds)
fn run(encrypted: bool, segs: &'static [Segment]) -> (u64, f64, f64, f64) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let secret = CaptureSecret::generate().unwrap();
    let key = CaptureKey::derive(b"bench-token", &secret, "bench", "sha256:bench", &PromptDigest::of(&[1, 2, 3])).unwrap();
    let k2 = key.clone();
    let seal = Seal::Complete { blocks: segs.len() as u32, tokens: segs.last().map_or(0, |s| s.header.end) };
    let sender = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let c0 = thread_cpu();
        s.set_nodelay(true).unwrap();
        if encrypted {
            let mut s2 = s.try_clone().unwrap();
            let hello = Hello::read(&mut s2).unwrap();
            let m = hello.try_key(&k2).unwrap();
            let mut ch = secure::accept(s, &hello, m).unwrap();
            for seg in segs {
                send_segment(&mut ch, seg).unwrap();
            }
            send_seal(&mut ch, &seal).unwrap();
        } else {
            let mut w = PlainFrames::new(BufWriter::with_capacity(1 << 18, s));
            for seg in segs {
                send_segment(&mut w, seg).unwrap();
            }
            send_seal(&mut w, &seal).unwrap();
        }
        thread_cpu() - c0
    });
    let c = TcpStream::connect(addr).unwrap();
    c.set_nodelay(true).unwrap();
    let limits = FrameLimits { segment: 64 << 20, ..FrameLimits::default() };
    let t0 = Instant::now();
    let c0 = thread_cpu();
    let bytes = if encrypted {
        let ch = secure::connect(c, &key, "bench").unwrap();
        read_all(SegmentReader::with_limits(ch, "bench", "sha256:bench", limits))
    } else {
        read_all(SegmentReader::with_limits(PlainFrames::new(BufReader::with_capacity(1 << 18, c)), "bench", "sha256:bench", limits))
    };
    let dt = t0.elapsed().as_secs_f64();
    let reader_cpu = thread_cpu() - c0;
    let sender_cpu = sender.join().unwrap();
    (bytes, dt, sender_cpu, reader_cpu)
}

/// One capture over `lanes` encrypted streams (the wire's lanes): a sending thread per lane
/// seals the segments its lane carries, a reading thread per lane opens and decodes them, as
/// ingest's lane readers do (the in-order hand-over to the block writer aside). (payload bytes,
/// wall seconds, summed sender CPU seconds, summed reader CPU seconds)
fn run_lanes(lanes: u8, segs: &'static [Segment]) -> (u64, f64, f64, f64) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let secret = CaptureSecret::generate().unwrap();
    let key = CaptureKey::derive(b"bench-token", &secret, "bench", "sha256:bench", &PromptDigest::of(&[1, 2, 3])).unwrap();
    let total = segs.len() as u32;
    let seal = Seal::Complete { blocks: total, tokens: segs.last().map_or(0, |s| s.header.end) };
    let k2 = key.clone();
    let server = std::thread::spawn(move || {
        let senders: Vec<_> = (0..lanes)
            .map(|_| {
                let (s, _) = l.accept().unwrap();
                let (key, seal) = (k2.clone(), seal.clone());
                std::thread::spawn(move || {
                    let c0 = thread_cpu();
                    s.set_nodelay(true).unwrap();
                    let mut s2 = s.try_clone().unwrap();
                    let hello = Hello::read(&mut s2).unwrap();
                    let lane = hello.lane;
                    let m = hello.try_key(&key).unwrap();
                    let mut ch = secure::accept(s, &hello, m).unwrap();
                    for seg in segs.iter().filter(|s| lane.carries(s.header.index)) {
                        send_segment(&mut ch, seg).unwrap();
                    }
                    send_seal(&mut ch, &seal).unwrap();
                    thread_cpu() - c0
                })
            })
            .collect();
        senders.into_iter().map(|t| t.join().unwrap()).sum::<f64>()
    });
    let limits = FrameLimits { segment: 64 << 20, ..FrameLimits::default() };
    let t0 = Instant::now();
    let readers: Vec<_> = Lane::all(lanes)
        .unwrap()
        .into_iter()
        .map(|lane| {
            let key = key.clone();
            std::thread::spawn(move || {
                let c0 = thread_cpu();
                let c = TcpStream::connect(addr).unwrap();
                c.set_nodelay(true).unwrap();
                let ch = secure::connect_lane(c, &key, "bench", lane).unwrap();
                let bytes = read_all(SegmentReader::with_limits(ch, "bench", "sha256:bench", limits).on_lane(lane));
                (bytes, thread_cpu() - c0)
            })
        })
        .collect();
    let (mut bytes, mut reader_cpu) = (0u64, 0f64);
    for r in readers {
        let (b, c) = r.join().unwrap();
        bytes += b;
        reader_cpu += c;
    }
    let dt = t0.elapsed().as_secs_f64();
    (bytes, dt, server.join().unwrap(), reader_cpu)
}

/// One side at a time on one thread, no socket: what each side's CPU work costs per byte.
fn in_memory(segs: &[Segment]) -> (f64, f64, f64, f64) {
    let payload: u64 = segs.iter().map(|s| s.arrays.iter().map(|a| a.len() as u64 * 2).sum::<u64>()).sum();
    let limits = FrameLimits { segment: 64 << 20, ..FrameLimits::default() };
    // clear
    let t = Instant::now();
    let mut buf = Vec::with_capacity(payload as usize + (1 << 20));
    for s in segs {
        send_segment(&mut buf, s).unwrap();
    }
    send_seal(&mut buf, &Seal::Complete { blocks: segs.len() as u32, tokens: 0 }).unwrap();
    let clear_send = payload as f64 / t.elapsed().as_secs_f64() / 1e9;
    let t = Instant::now();
    let got = read_all(SegmentReader::with_limits(&buf[..], "bench", "sha256:bench", limits));
    let clear_read = got as f64 / t.elapsed().as_secs_f64() / 1e9;
    drop(buf);
    // encrypted: the sending side writes records into memory, the reading side opens them
    let (send, read) = pd_bridge_core::wire::fuzz::bench_in_memory(segs, limits);
    (clear_send, clear_read, payload as f64 / send / 1e9, payload as f64 / read / 1e9)
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let total_mib = args.first().copied().unwrap_or(2048);
    let seg_mib = args.get(1).copied().unwrap_or(4);
    let rounds = args.get(2).copied().unwrap_or(3);
    let count = (total_mib / seg_mib).max(1);
    let segs: &'static [Segment] = Box::leak(segments(count, seg_mib << 20).into_boxed_slice());
    let per = segs[0].arrays.iter().map(|a| a.len() * 2).sum::<usize>();
    println!("bench_wire: {count} segments of {:.2} MiB ({:.0} MiB) per stream, loopback TCP, {} CPUs", per as f64 / (1 << 20) as f64, (count * per) as f64 / (1 << 20) as f64, std::thread::available_parallelism().map_or(0, |n| n.get()));
    let mut best = [0f64; 2];
    let mut best_cpu = [0f64; 2];
    for round in 0..rounds {
        for (i, enc) in [false, true].into_iter().enumerate() {
            let (bytes, dt, scpu, rcpu) = run(enc, segs);
            let gbs = bytes as f64 / dt / 1e9;
            // The rate each side sustains per CPU-second: the stream's rate when each side has a
            // core to itself (on a machine shared with other work, wall time says less).
            let cpu_gbs = bytes as f64 / scpu.max(rcpu) / 1e9;
            best[i] = best[i].max(gbs);
            best_cpu[i] = best_cpu[i].max(cpu_gbs);
            println!(
                "  round {round}: {:<9} {gbs:.2} GB/s wall ({:.0} MiB in {dt:.3} s); CPU: sender {scpu:.3} s, reader {rcpu:.3} s -> {cpu_gbs:.2} GB/s per core-pair",
                if enc { "encrypted" } else { "clear" },
                bytes as f64 / (1 << 20) as f64
            );
        }
    }
    // One capture over several lanes, each lane count in the same run as the single stream above.
    let lane_counts: Vec<u8> = std::env::var("BENCH_WIRE_LANES").ok().map(|v| v.split(',').map(|x| x.trim().parse().expect("lane counts")).collect()).unwrap_or_else(|| vec![2, 4, 8]);
    let mut lane_best = vec![];
    for &lanes in &lane_counts {
        let mut best = 0f64;
        for round in 0..rounds {
            let (bytes, dt, scpu, rcpu) = run_lanes(lanes, segs);
            let gbs = bytes as f64 / dt / 1e9;
            best = best.max(gbs);
            println!("  round {round}: encrypted over {lanes} lanes {gbs:.2} GB/s wall ({:.0} MiB in {dt:.3} s); CPU: senders {scpu:.3} s, readers {rcpu:.3} s", bytes as f64 / (1 << 20) as f64);
        }
        lane_best.push((lanes, best));
    }
    let (cs, cr, es, er) = in_memory(&segs[..segs.len().min(128)]);
    println!("one side on one thread, in memory: clear send {cs:.2} / read {cr:.2} GB/s; encrypted send {es:.2} / read {er:.2} GB/s");
    println!("best of {rounds}: clear {:.2} GB/s, encrypted {:.2} GB/s wall; per core-pair (payload / busier side's CPU time) clear {:.2}, encrypted {:.2} GB/s ({}; target >= 1.25 GB/s per stream)", best[0], best[1], best_cpu[0], best_cpu[1], secure::NOISE_PARAMS);
    let lanes: Vec<String> = lane_best.iter().map(|(l, g)| format!("{l} lanes {g:.2} GB/s")).collect();
    println!("one capture over several lanes, encrypted, best of {rounds}: 1 lane {:.2} GB/s, {} (target >= 5 GB/s for one capture)", best[1], lanes.join(", "));
}
