//! pd-bridge core: the decoder's cache math and everything that carries its result.
//!
//! The data path, in module order: [`plan`] (what the decoder caches, from its config) →
//! [`weights`] (the decoder's own projection weights, in any format [`quant`] reads, and their
//! fingerprint; [`checkpoint`]: the model's identity and its export for the GPU host) → [`pooler`] (the
//! per-layer cache state, fed chunk by chunk, each layer's math its model [`family`]'s) →
//! [`capture`] (segments at block boundaries, planned by [`segment`]) → [`segment_server`] and
//! [`wire`] (the prefill host's side of the stream) → [`ingest`] and [`block`] (the decode host's
//! side: the oMLX block writer and validator).
//!
//! What they share sits on the floors below: [`error`] and [`view`] (a layer's state as arrays),
//! which import nothing of the crate, then [`numerics`] (the MLX arithmetic), [`format`] (which
//! oMLX) and [`geometry`] (what a block holds at a boundary). `core/tests/no_import_cycle.rs`
//! keeps the core's files free of import cycles.

pub mod backend;
pub mod block;
pub mod capture;
pub mod checkpoint;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod error;
pub mod family;
pub mod format;
pub mod geometry;
pub mod ingest;
pub mod numerics;
pub mod options;
pub mod plan;
pub mod quant;
pub mod pooler;
pub mod segment;
pub mod segment_server;
pub mod stages;
pub(crate) mod sync;
pub mod view;
pub mod weights;
pub mod wire;

pub use error::{CoreError, DeviceFailure, Result};
pub use options::{CaptureOptions, GemmMode};
pub use format::OmlxFormat;
pub use plan::ModelPlan;
pub use pooler::{CacheBuilder, DecoderSteps};
pub use view::StateArray;
pub use weights::DecoderWeights;
