//! oMLX's prefix-cache blocks: the chain hash that names them, the file layout oMLX writes, which
//! cache state each block carries, the writer, and the validator that guards what oMLX may load.

pub mod assembler;
pub mod chain;
pub mod file;
pub mod layout;
pub mod pyjson;
pub mod read;
pub mod spec;
pub mod validate;
pub mod writer;

pub use chain::{block_hash, chain, ChainHash};
pub use writer::{block_path, BlockWriter, Landed, Written};
