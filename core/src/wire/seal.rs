//! How a capture ended: the last frame of every stream (and of every lane).

use serde::{Deserialize, Serialize};

/// How a capture ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Seal {
    /// Every full block of the prompt was sent.
    Complete { blocks: u32, tokens: u64 },
    /// Only a prefix was sent (still valid); `reason` says why.
    Partial { blocks: u32, tokens: u64, reason: String },
    /// The request was aborted or failed on the prefill host; `blocks` sent before it.
    Aborted { blocks: u32, reason: String },
}

impl Seal {
    /// Blocks sent before the seal.
    pub fn blocks(&self) -> u32 {
        match self {
            Seal::Complete { blocks, .. } | Seal::Partial { blocks, .. } | Seal::Aborted { blocks, .. } => *blocks,
        }
    }
}
