//! The store under a structured fuzzer, a bounded number of cases: the segment decoder and the
//! writer's admission, the block validator and the config parser, from valid inputs with
//! structured mutations (see `fuzz/store.rs`). No panic, every rejection typed, what is accepted
//! holds up. `cargo run --release --example fuzz_store` runs the same cases for longer.

mod common;
#[path = "fuzz/store.rs"]
mod engine;

use std::sync::OnceLock;

use engine::{block_case, case, config_case, segment_case, Outcome, Seeds};
use proptest::prelude::*;

fn seeds() -> &'static Seeds {
    static S: OnceLock<Seeds> = OnceLock::new();
    S.get_or_init(Seeds::new)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn segment_decoder_and_admission((pick, muts) in case()) {
        let dir = seeds().scratch.join(format!("seg-{pick}"));
        let out = segment_case(seeds(), pick, &muts, pick % 8 == 0, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        prop_assert!(out.is_ok(), "{:?}: {}", muts, out.unwrap_err());
    }

    #[test]
    fn block_validator((pick, muts) in case()) {
        let dir = seeds().scratch.join(format!("blk-{pick}"));
        let out = block_case(seeds(), pick, &muts, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        prop_assert!(out.is_ok(), "{:?}: {}", muts, out.unwrap_err());
    }

    #[test]
    fn config_parser((pick, muts) in case()) {
        let out = config_case(seeds(), pick, &muts);
        prop_assert!(out.is_ok(), "{:?}: {}", muts, out.unwrap_err());
    }
}

/// The fuzzer reaches past the framing: the unmutated seeds are accepted and some mutated
/// cases reach each deeper check (so a bounded run is not all "header is not JSON").
#[test]
fn the_seeds_are_accepted_and_mutations_reach_the_deep_checks() {
    let s = seeds();
    for pick in 0..9 {
        assert_eq!(segment_case(s, pick, &[engine::Mutation::Fit], false, &s.scratch.join("deep")).unwrap(), Outcome::Accepted, "segment seed {pick}");
    }
    for pick in 0..s.blocks.len() {
        if pick % 3 != 0 {
            assert_eq!(block_case(s, pick, &[engine::Mutation::Fit], &s.scratch.join("deep-b")).unwrap(), Outcome::Accepted, "block seed {pick}");
        }
    }
    let nan = [engine::Mutation::Special { at: 3, kind: 0 }];
    assert_eq!(segment_case(s, 0, &nan, false, &s.scratch.join("deep")).unwrap(), Outcome::Rejected("segment"));
    let wide = [engine::Mutation::Nudge { pick: 0, delta: 0 }];
    let _ = segment_case(s, 0, &wide, false, &s.scratch.join("deep")).unwrap();
}
