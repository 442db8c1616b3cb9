//! The capture engine's settings ([`CaptureOptions`]): one plain value, built once at the
//! boundary (the Python bindings read the `PD_BRIDGE_GPU*` environment variables when a capture
//! is created, benchmarks and tests build it themselves) and passed in; nothing below reads the
//! environment. The defaults are what the GPU path measured best on an H200 (BENCHMARKS.md).
//!
//! The ground floor: this file imports nothing of the crate, so every other file may use it.

/// How the GPU path computes the projections (`PD_BRIDGE_GPU_GEMM=exact|tensor`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GemmMode {
    /// Sequential f32 accumulation per output, like the CPU reference: bit-exact, CUDA cores.
    Exact,
    /// cuBLAS bf16 GEMM with f32 accumulation on tensor cores: fast, not bit-exact (default).
    #[default]
    TensorCore,
}

/// Post streams when `PD_BRIDGE_GPU_POST_STREAMS` is unset. On the H200 (DeepSeek-V4-Flash
/// shapes, 2048-token chunks) 1 stream gave 49% of the GEMM roofline, 4 gave 56%, 8 gave 58%
/// at high priority and 60–61% at normal priority.
pub const DEFAULT_POST_STREAMS: usize = 8;

/// Settings of a capture's GPU path. Every field has its environment variable (read at the
/// boundary by [`CaptureOptions::from_vars`]) and its default ([`Default`]); the CPU path reads
/// none of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaptureOptions {
    /// Pool CUDA tensors on the GPU (`PD_BRIDGE_GPU`, default on; `0`: copy them to the host and
    /// pool on the CPU).
    pub gpu: bool,
    /// How the projections are computed (`PD_BRIDGE_GPU_GEMM`, default tensor cores).
    pub gemm: GemmMode,
    /// Upstream oMLX's format on the GPU too (`PD_BRIDGE_GPU_UPSTREAM`, default on; `0` sends it
    /// to the CPU).
    pub upstream: bool,
    /// Streams the small kernels after the projections run on, layer L on stream L mod n
    /// (`PD_BRIDGE_GPU_POST_STREAMS`, default [`DEFAULT_POST_STREAMS`], used clamped to 1..=8).
    pub post_streams: usize,
    /// Projection-output slots (`PD_BRIDGE_GPU_SLOTS`, default 2; at least one more than the post
    /// streams is used; 16 instead of 9 measured no faster on the H200).
    pub slots: usize,
    /// Post streams at high priority (`PD_BRIDGE_GPU_POST_PRIORITY=1`, default off: measured
    /// slower with several post streams, they then crowd out the GEMMs).
    pub post_priority: bool,
    /// Streams finished block bodies leave the device on, block k on stream k mod n
    /// (`PD_BRIDGE_GPU_COPY_STREAMS`, default 4, used clamped to 1..=8).
    pub copy_streams: usize,
    /// Blocks in flight beyond which a feed first waits for queued copies
    /// (`PD_BRIDGE_GPU_OPEN_BLOCKS`; default `None`: twice the blocks the first chunk touches, plus
    /// two each; at least 2 is used).
    pub open_blocks: Option<usize>,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions {
            gpu: true,
            gemm: GemmMode::TensorCore,
            upstream: true,
            post_streams: DEFAULT_POST_STREAMS,
            slots: 2,
            post_priority: false,
            copy_streams: 4,
            open_blocks: None,
        }
    }
}

impl CaptureOptions {
    /// The environment variables [`Self::from_vars`] reads.
    pub const VARS: [&'static str; 8] = [
        "PD_BRIDGE_GPU",
        "PD_BRIDGE_GPU_GEMM",
        "PD_BRIDGE_GPU_UPSTREAM",
        "PD_BRIDGE_GPU_POST_STREAMS",
        "PD_BRIDGE_GPU_SLOTS",
        "PD_BRIDGE_GPU_POST_PRIORITY",
        "PD_BRIDGE_GPU_COPY_STREAMS",
        "PD_BRIDGE_GPU_OPEN_BLOCKS",
    ];

    /// The options from named settings: `get(name)` is a variable's value, `None` where unset
    /// (the boundary passes `|k| std::env::var(k).ok()`). Values that do not parse keep the
    /// default, as the variables always did.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Self {
        let d = CaptureOptions::default();
        let num = |k: &str| get(k).and_then(|v| v.parse::<usize>().ok());
        CaptureOptions {
            gpu: get("PD_BRIDGE_GPU").as_deref() != Some("0"),
            gemm: match get("PD_BRIDGE_GPU_GEMM").as_deref() {
                Some("exact") => GemmMode::Exact,
                _ => GemmMode::TensorCore,
            },
            upstream: get("PD_BRIDGE_GPU_UPSTREAM").as_deref() != Some("0"),
            post_streams: num("PD_BRIDGE_GPU_POST_STREAMS").unwrap_or(d.post_streams),
            slots: num("PD_BRIDGE_GPU_SLOTS").unwrap_or(d.slots),
            post_priority: get("PD_BRIDGE_GPU_POST_PRIORITY").as_deref() == Some("1"),
            copy_streams: num("PD_BRIDGE_GPU_COPY_STREAMS").unwrap_or(d.copy_streams),
            open_blocks: num("PD_BRIDGE_GPU_OPEN_BLOCKS"),
        }
    }

    /// Post streams used: [`Self::post_streams`] clamped to 1..=8.
    pub fn post_streams_used(&self) -> usize {
        self.post_streams.clamp(1, 8)
    }

    /// Projection slots used: at least 2 and one more than the post streams.
    pub fn slots_used(&self) -> usize {
        self.slots.max(2).max(self.post_streams_used() + 1)
    }

    /// Copy streams used: [`Self::copy_streams`] clamped to 1..=8.
    pub fn copy_streams_used(&self) -> usize {
        self.copy_streams.clamp(1, 8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_variables_give_the_defaults_and_each_variable_its_field() {
        assert_eq!(CaptureOptions::from_vars(|_| None), CaptureOptions::default());
        let vars = [
            ("PD_BRIDGE_GPU", "0"),
            ("PD_BRIDGE_GPU_GEMM", "exact"),
            ("PD_BRIDGE_GPU_UPSTREAM", "0"),
            ("PD_BRIDGE_GPU_POST_STREAMS", "3"),
            ("PD_BRIDGE_GPU_SLOTS", "6"),
            ("PD_BRIDGE_GPU_POST_PRIORITY", "1"),
            ("PD_BRIDGE_GPU_COPY_STREAMS", "12"),
            ("PD_BRIDGE_GPU_OPEN_BLOCKS", "5"),
        ];
        assert_eq!(vars.map(|(k, _)| k), CaptureOptions::VARS);
        let o = CaptureOptions::from_vars(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string()));
        let want = CaptureOptions { gpu: false, gemm: GemmMode::Exact, upstream: false, post_streams: 3, slots: 6, post_priority: true, copy_streams: 12, open_blocks: Some(5) };
        assert_eq!(o, want);
        assert_eq!((o.post_streams_used(), o.slots_used(), o.copy_streams_used()), (3, 6, 8));
        // Values that do not parse keep the defaults; anything but "0" leaves a switch on.
        let bad = CaptureOptions::from_vars(|k| Some(if k == "PD_BRIDGE_GPU_GEMM" { "tensor" } else { "x" }.into()));
        assert_eq!(bad, CaptureOptions::default());
        assert_eq!(CaptureOptions::default().slots_used(), 9);
    }
}
