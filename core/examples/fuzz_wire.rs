//! The wire's fuzz targets (`pd_bridge_core::wire::fuzz`) for a longer run than `cargo test`'s:
//! random and structured inputs for each target in turn, printing cases per second and every
//! finding (a panic: a crash, or a broken invariant) with its seed.
//!
//! `cargo run --release -p pd-bridge-core --example fuzz_wire -- [seconds per target] [seed]`

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use pd_bridge_core::wire::fuzz;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, max: usize) -> Vec<u8> {
        let n = self.below(max + 1);
        (0..n).map(|_| self.next() as u8).collect()
    }
    /// A length worth trying: small, near a limit, huge, or anything.
    fn length(&mut self) -> u64 {
        match self.below(5) {
            0 => self.below(64) as u64,
            1 => (1 << 20) + self.below(3) as u64 - 1,
            2 => 8 << 30,
            3 => u64::MAX - self.below(2) as u64,
            _ => self.next(),
        }
    }
}

use pd_bridge_core::wire::fuzz::segments;

fn mutate(r: &mut Rng, b: &mut Vec<u8>) {
    for _ in 0..1 + r.below(3) {
        if b.is_empty() {
            return;
        }
        let at = r.below(b.len());
        match r.below(4) {
            0 => b[at] ^= 1 + r.below(255) as u8,
            1 => b.truncate(at),
            2 => {
                let ins = r.bytes(32);
                b.splice(at..at, ins);
            }
            _ => {
                let end = (at + 1 + r.below(64)).min(b.len());
                b.drain(at..end);
            }
        }
    }
}


fn main() {
    let args: Vec<u64> = std::env::args().skip(1).map(|a| a.parse().expect("a number")).collect();
    let secs = args.first().copied().unwrap_or(10);
    let seed0 = args.get(1).copied().unwrap_or(0x9e37_79b9_7f4a_7c15);
    let small = segments(3, 8);
    let wide = segments(2, 4096);
    let targets: Vec<(&str, Box<dyn Fn(&mut Rng)>)> = vec![
        ("plain frames, random bytes", Box::new(|r: &mut Rng| { fuzz::plain_frames(&r.bytes(2048)); })),
        ("plain frames, mutated valid stream", Box::new(|r: &mut Rng| { fuzz::mutated_plain(&small, |b| mutate(r, b)); })),
        ("hello parser", Box::new(|r: &mut Rng| {
            let mut h = b"PDBW".to_vec();
            h.extend_from_slice(&[pd_bridge_core::wire::VERSION, 1]);
            h.extend_from_slice(&(r.below(300) as u16).to_le_bytes());
            h.extend(r.bytes(600));
            if r.below(4) == 0 {
                h = r.bytes(600);
            }
            fuzz::hello(&h);
        })),
        ("client handshake, arbitrary answer", Box::new(|r: &mut Rng| {
            let mut a = b"PDBW".to_vec();
            a.extend_from_slice(&[pd_bridge_core::wire::VERSION, r.below(5) as u8]);
            a.extend_from_slice(&(r.below(300) as u16).to_le_bytes());
            a.extend(r.bytes(300));
            fuzz::client_handshake(&a);
        })),
        ("encrypted reader, unauthenticated bytes", Box::new(|r: &mut Rng| { fuzz::secure_garbage(&r.bytes(4096)); })),
        ("encrypted reader, hostile authenticated records", Box::new(|r: &mut Rng| {
            let records: Vec<Vec<u8>> = (0..r.below(12))
                .map(|_| {
                    let mut v = vec![[1u8, 3, 4, 5, r.next() as u8][r.below(5)]];
                    v.extend_from_slice(&r.length().to_le_bytes());
                    v.extend(r.bytes(256));
                    if r.below(3) == 0 {
                        v = r.bytes(512);
                    }
                    v
                })
                .collect();
            fuzz::hostile_records(&records);
        })),
        ("encrypted reader, mutated valid stream", Box::new(|r: &mut Rng| {
            let segs = if r.below(2) == 0 { &small } else { &wide };
            fuzz::mutated_stream(segs, |b| mutate(r, b));
        })),
    ];
    std::panic::set_hook(Box::new(|_| {}));
    println!("fuzz_wire: {} targets, {secs} s each, seed {seed0:#x}", targets.len());
    let mut findings = 0;
    for (ti, (name, f)) in targets.iter().enumerate() {
        let t0 = Instant::now();
        let mut cases = 0u64;
        while t0.elapsed() < Duration::from_secs(secs) {
            let seed = seed0 ^ ((ti as u64) << 56) ^ cases.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
            let mut r = Rng(seed);
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(&mut r))) {
                findings += 1;
                let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                println!("  FINDING in {name}: seed {seed:#x}: {msg}");
            }
            cases += 1;
        }
        println!("  {name:<48} {cases:>9} cases  {:>9.0} cases/s", cases as f64 / t0.elapsed().as_secs_f64());
    }
    println!("findings: {findings}");
}
