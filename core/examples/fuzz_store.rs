//! The store's structured fuzzer, run for longer than the test command does: the segment decoder
//! with the writer's admission (and, for one case in eight, the write), the block validator and
//! the config parser, from valid inputs with structured mutations (`tests/fuzz/store.rs`).
//!
//!     cargo run --release -p pd-bridge-core --example fuzz_store -- [SECONDS_PER_TARGET] [SEED]
//!
//! Prints, per target, cases run, cases per second, the outcomes (accepted / rejected by kind)
//! and every finding (a panic, an untyped rejection, or something accepted that must not be),
//! with the mutations that produced it. Exits 1 when there is a finding.

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/fuzz/store.rs"]
mod engine;

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let secs: f64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(20.0);
    let seed: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1);
    let seeds = engine::Seeds::new();
    // A panic is a finding, counted below; keep its default report off the terminal.
    std::panic::set_hook(Box::new(|_| {}));
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes));
    let strategy = engine::case();
    let mut total_findings = 0;
    for target in ["segment", "block", "config"] {
        let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
        let mut findings: Vec<String> = Vec::new();
        let (t0, mut n) = (Instant::now(), 0u64);
        while t0.elapsed() < Duration::from_secs_f64(secs) {
            let (pick, muts) = strategy.new_tree(&mut runner).expect("a case").current();
            let dir = seeds.scratch.join(format!("ex-{target}-{}", n % 64));
            let got = catch_unwind(AssertUnwindSafe(|| match target {
                "segment" => engine::segment_case(&seeds, pick, &muts, pick % 8 == 0, &dir),
                "block" => engine::block_case(&seeds, pick, &muts, &dir),
                _ => engine::config_case(&seeds, pick, &muts),
            }));
            let _ = std::fs::remove_dir_all(&dir);
            let key = match got {
                Ok(Ok(engine::Outcome::Accepted)) => "accepted".to_string(),
                Ok(Ok(engine::Outcome::Rejected(k))) => format!("rejected/{k}"),
                Ok(Err(finding)) => {
                    findings.push(format!("{finding} <- seed {pick}, {muts:?}"));
                    "FINDING".into()
                }
                Err(p) => {
                    let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                    findings.push(format!("panic: {msg} <- seed {pick}, {muts:?}"));
                    "PANIC".into()
                }
            };
            *outcomes.entry(key).or_default() += 1;
            n += 1;
        }
        let dt = t0.elapsed().as_secs_f64();
        println!("{target}: {n} cases in {dt:.1}s = {:.0} cases/s; {outcomes:?}; findings: {}", n as f64 / dt, findings.len());
        for f in findings.iter().take(10) {
            println!("  {f}");
        }
        total_findings += findings.len();
    }
    std::process::exit(if total_findings > 0 { 1 } else { 0 });
}
