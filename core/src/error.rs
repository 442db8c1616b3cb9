//! Typed errors of the core. Every rejection names what was wrong; the binding crates map each
//! variant to its own Python exception.
//!
//! The ground floor: this file imports nothing of the crate, so every other file may use it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// The decoder's `config.json` is missing a field, has the wrong type, or asks for something
    /// the core does not implement.
    #[error("config {field}: {reason}")]
    Config { field: String, reason: String },

    /// A weight tensor is missing, has the wrong dtype/shape, or is quantized in a way the core
    /// cannot dequantize exactly.
    #[error("weight {tensor}: {reason}")]
    Weights { tensor: String, reason: String },

    /// A safetensors file could not be parsed.
    #[error("weight file {path}: {reason}")]
    WeightFile { path: PathBuf, reason: String },

    /// Attention input that does not fit the layer state: wrong width, a gap or overlap in
    /// token positions, an unknown layer.
    #[error("input for layer {layer}: {reason}")]
    Input { layer: usize, reason: String },

    /// A malformed, out-of-order or foreign segment stream.
    #[error("wire: {0}")]
    Wire(String),

    /// A segment that does not fit the decoder's plan or the block grid, refused before anything
    /// is written: the block it claims, the layer and array (where one is at fault), and why.
    #[error("segment for block {block}{at}: {reason}", at = segment_at(*.layer, .array.as_deref()))]
    Segment { block: u64, layer: Option<usize>, array: Option<String>, reason: String },

    /// A peer that does not hold the shared token.
    #[error("auth: {0}")]
    Auth(String),

    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    /// A carry state (resuming a capture at a block boundary) that is malformed or does not fit
    /// the capture: `what` names the part that disagrees (weights, format, block size, position,
    /// layers) or the block file it could not be read from.
    #[error("carry state, {what}: {reason}")]
    Carry { what: CarryField, reason: String },

    /// The GPU path failed (or was asked for where there is none): `what` names the part that
    /// failed (driver, out of memory, cuBLAS, NVRTC, ...), `reason` the call and its answer.
    #[error("device, {what}: {reason}")]
    Device { what: DeviceFailure, reason: String },
}

/// What failed on the GPU path, for [`CoreError::Device`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceFailure {
    /// The core was built without the `cuda` feature, yet a GPU was asked for.
    NotBuilt,
    /// A CUDA library (libcuda, libcublas, libnvrtc) could not be loaded.
    Library,
    /// No such CUDA device (or none at all).
    NoDevice,
    /// Device or page-locked host memory ran out.
    OutOfMemory,
    /// A CUDA driver call failed (context, stream, event, copy, kernel launch).
    Driver,
    /// cuBLAS failed (handle creation, a GEMM).
    Cublas,
    /// NVRTC could not compile the kernels (or their PTX could not be used).
    Nvrtc,
    /// The GPU capture's own state: an earlier failure, or a request it cannot serve (a carry
    /// state that does not fit its layers, a block it never gathered).
    Capture,
}

impl std::fmt::Display for DeviceFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceFailure::NotBuilt => "built without CUDA",
            DeviceFailure::Library => "CUDA library",
            DeviceFailure::NoDevice => "no CUDA device",
            DeviceFailure::OutOfMemory => "out of memory",
            DeviceFailure::Driver => "CUDA driver",
            DeviceFailure::Cublas => "cuBLAS",
            DeviceFailure::Nvrtc => "NVRTC",
            DeviceFailure::Capture => "GPU capture",
        })
    }
}

/// What a carry state disagrees on (or why it cannot be read), for [`CoreError::Carry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CarryField {
    /// The bytes: magic, version, checksum, header, array lengths.
    Framing,
    /// Made from other decoder weights.
    Fingerprint,
    /// Made for another oMLX block format.
    Format,
    /// Made for another block size.
    BlockSize,
    /// Not at the position it claims, off the block grid, or past the prompt.
    Position,
    /// Layers that do not fit the model: count, kinds, ratios, widths.
    Plan,
    /// The block file it is read from is invalid or not what it should be.
    Block,
    /// Taken at the end of another prefix (its chain hash is not this prompt's).
    Prefix,
}

impl std::fmt::Display for CarryField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CarryField::Framing => "framing",
            CarryField::Fingerprint => "weights fingerprint",
            CarryField::Format => "oMLX block format",
            CarryField::BlockSize => "block size",
            CarryField::Position => "position",
            CarryField::Plan => "model plan",
            CarryField::Block => "block file",
            CarryField::Prefix => "prefix",
        })
    }
}

pub type Result<T> = std::result::Result<T, CoreError>;

fn segment_at(layer: Option<usize>, array: Option<&str>) -> String {
    match (layer, array) {
        (Some(l), Some(a)) => format!(", layer {l} array {a}"),
        (Some(l), None) => format!(", layer {l}"),
        (None, Some(a)) => format!(", {a}"),
        (None, None) => String::new(),
    }
}

impl CoreError {
    pub(crate) fn config(field: impl Into<String>, reason: impl Into<String>) -> Self {
        CoreError::Config { field: field.into(), reason: reason.into() }
    }
    pub(crate) fn weights(tensor: impl Into<String>, reason: impl Into<String>) -> Self {
        CoreError::Weights { tensor: tensor.into(), reason: reason.into() }
    }
    pub(crate) fn input(layer: usize, reason: impl Into<String>) -> Self {
        CoreError::Input { layer, reason: reason.into() }
    }
    pub(crate) fn wire(reason: impl Into<String>) -> Self {
        CoreError::Wire(reason.into())
    }
    pub(crate) fn segment(block: u64, layer: Option<usize>, array: Option<&str>, reason: impl Into<String>) -> Self {
        CoreError::Segment { block, layer, array: array.map(str::to_string), reason: reason.into() }
    }
    pub(crate) fn device(what: DeviceFailure, reason: impl Into<String>) -> Self {
        CoreError::Device { what, reason: reason.into() }
    }
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CoreError::Io { path: path.into(), source }
    }
}
