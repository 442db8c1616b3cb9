//! The wire's parsers under a structured fuzzer, a bounded number of cases per `cargo test`
//! (the long run: `cargo run --release --example fuzz_wire`). Targets: `wire::fuzz`.

use pd_bridge_core::wire::fuzz;
use proptest::prelude::*;

use pd_bridge_core::wire::fuzz::segments;

#[derive(Clone, Debug)]
enum Mutation {
    Flip { at: usize, xor: u8 },
    Truncate { at: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Remove { at: usize, len: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, xor)| Mutation::Flip { at, xor }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..32)).prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (any::<usize>(), 1usize..64).prop_map(|(at, len)| Mutation::Remove { at, len }),
    ]
}

fn apply(m: &Mutation, b: &mut Vec<u8>) {
    if b.is_empty() {
        return;
    }
    match m {
        Mutation::Flip { at, xor } => {
            let i = at % b.len();
            b[i] ^= xor;
        }
        Mutation::Truncate { at } => b.truncate(at % b.len()),
        Mutation::Insert { at, bytes } => {
            let i = at % b.len();
            b.splice(i..i, bytes.iter().copied());
        }
        Mutation::Remove { at, len } => {
            let i = at % b.len();
            let j = (i + len).min(b.len());
            b.drain(i..j);
        }
    }
}

/// A plaintext record as a hostile (authenticated) peer might send: often a frame head with a
/// chosen kind and length, then arbitrary bytes.
fn hostile_record() -> impl Strategy<Value = Vec<u8>> {
    let head = (prop_oneof![Just(1u8), Just(3), Just(4), Just(5), any::<u8>()], prop_oneof![0u64..64, 0u64..(2 << 20), Just(8u64 << 30), Just(u64::MAX), any::<u64>()]);
    prop_oneof![
        (head, prop::collection::vec(any::<u8>(), 0..256)).prop_map(|((k, len), rest)| {
            let mut v = vec![k];
            v.extend_from_slice(&len.to_le_bytes());
            v.extend(rest);
            v
        }),
        prop::collection::vec(any::<u8>(), 0..512),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, .. ProptestConfig::default() })]

    #[test]
    fn plain_frames_from_arbitrary_bytes(data in prop::collection::vec(any::<u8>(), 0..2048)) {
        fuzz::plain_frames(&data);
    }

    #[test]
    fn hello_from_arbitrary_bytes(data in prop::collection::vec(any::<u8>(), 0..600), id_len in 0u16..300) {
        fuzz::hello(&data);
        // The same bytes behind a well-formed preamble, so the parser reaches its length checks.
        let mut framed = b"PDBW".to_vec();
        framed.extend_from_slice(&[pd_bridge_core::wire::VERSION, 1]);
        framed.extend_from_slice(&id_len.to_le_bytes());
        framed.extend_from_slice(&data);
        fuzz::hello(&framed);
    }

    #[test]
    fn client_handshake_against_arbitrary_answers(data in prop::collection::vec(any::<u8>(), 0..200), len in 0u16..300, kind in 0u8..5) {
        fuzz::client_handshake(&data);
        let mut framed = b"PDBW".to_vec();
        framed.extend_from_slice(&[pd_bridge_core::wire::VERSION, kind]);
        framed.extend_from_slice(&len.to_le_bytes());
        framed.extend_from_slice(&data);
        fuzz::client_handshake(&framed);
    }

    #[test]
    fn encrypted_reader_accepts_nothing_unauthenticated(data in prop::collection::vec(any::<u8>(), 0..4096)) {
        fuzz::secure_garbage(&data);
    }

    #[test]
    fn encrypted_reader_against_a_hostile_authenticated_peer(records in prop::collection::vec(hostile_record(), 0..12)) {
        fuzz::hostile_records(&records);
    }

    #[test]
    fn mutated_encrypted_streams_yield_only_what_was_sent(n in 0usize..4, width in prop_oneof![Just(8usize), Just(4096)], muts in prop::collection::vec(mutation(), 0..3)) {
        let segs = segments(n, width);
        fuzz::mutated_stream(&segs, |b| for m in &muts { apply(m, b) });
    }

    #[test]
    fn mutated_plain_streams(n in 0usize..4, muts in prop::collection::vec(mutation(), 1..4)) {
        let segs = segments(n, 8);
        fuzz::mutated_plain(&segs, |b| for m in &muts { apply(m, b) });
    }
}
