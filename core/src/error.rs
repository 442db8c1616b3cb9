//! Typed errors of the core. Every rejection names what was wrong; the binding crates map each
//! variant to its own Python exception.

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

    /// A peer that does not hold the shared token.
    #[error("auth: {0}")]
    Auth(String),

    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

pub type Result<T> = std::result::Result<T, CoreError>;

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
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CoreError::Io { path: path.into(), source }
    }
}
