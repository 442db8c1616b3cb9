//! oMLX's prefix-cache blocks: the chain hash that names them, the file layout oMLX writes, and
//! (per model family) which cache state each block carries.

pub mod chain;
pub mod file;
pub mod pyjson;

pub use chain::{block_hash, chain, ChainHash};
