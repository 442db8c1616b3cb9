//! pd-bridge core: the decoder's cache math and everything that carries its result.
//!
//! The data path, in module order: [`plan`] (what the decoder caches, from its config) →
//! [`weights`] (the decoder's own projection weights and their fingerprint) → [`pooler`] (the
//! per-layer cache state, fed chunk by chunk) → segments, wire and the oMLX block writer (later
//! modules). [`numerics`] holds the MLX arithmetic they all share.

pub mod block;
pub mod capture;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod format;
pub mod geometry;
pub mod ingest;
pub mod numerics;
pub mod plan;
pub mod pooler;
pub mod segment;
pub mod segment_server;
pub(crate) mod sync;
pub mod view;
pub mod weights;
pub mod wire;

pub use error::{CoreError, Result};
pub use format::OmlxFormat;
pub use plan::ModelPlan;
pub use pooler::{CacheBuilder, DecoderSteps};
pub use view::StateArray;
pub use weights::DecoderWeights;
