//! Which oMLX the blocks are for: every protocol detail that differs between supported oMLX
//! releases, in one descriptor. The block layout, the writer, the validator, the pooler's
//! overlap semantics and the capture all take an [`OmlxFormat`]; Python names it
//! (`pd_bridge_omlx/versions.py` maps an installed distribution to the name).
//!
//! Adding a release is one variant here and its answers below. Known ahead from upstream's
//! public history: oMLX 0.7.0 adds `parent_hash` / `tail_terminal` metadata, short tail blocks
//! salted `"omlx-tail-v1"` and a 5-tuple pooling signature; it would be an `Upstream070` whose
//! answers are `Upstream063`'s plus those keys and the tail rule in the chain.

use crate::error::{CoreError, Result};
use crate::plan::ModelPlan;

/// A supported oMLX block format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OmlxFormat {
    /// PyPI `flyto-mlx` 0.7.0 (its `omlx` is upstream 0.3.9.dev1 plus backports).
    #[default]
    Fork070,
    /// Upstream oMLX (jundot/omlx) 0.6.3.
    Upstream063,
}

/// How a DeepSeek-V4 block stores its compressor pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolLayout {
    /// Every block carries the whole pools up to its boundary (`PoolingCache`, 3 elements).
    Full,
    /// Every block carries only the pooled rows new in it, the previous ratio-4 window and the
    /// absolute row range (`PoolingCacheDelta`, 6 elements): the store grows linearly.
    Delta,
}

/// How the decoder's ratio-4 compressor treats the previous window across forward calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    /// The first window of each forward call sees a zero previous window (the fork).
    RestartPerCall,
    /// The previous window carries across calls in the cache (upstream #2271, since 0.5.2rc1).
    Carried,
}

/// How the decoder's MLX sums a compressor window's bf16 products (`(kv * weights).sum(axis=-2)`
/// on bf16 arrays), as its CPU reduction kernel does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolSum {
    /// An f32 accumulator in row order, rounded to bf16 once (mlx 0.32.3, the fork's venv).
    F32,
    /// A bf16 accumulator in row order: every partial sum rounded to bf16 (mlx 0.32.0, which
    /// upstream oMLX 0.6.3 pins exactly: `mlx==0.32.0`).
    Bf16,
}

/// What oMLX hashes into every block key and stamps as `model_name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelNameRule {
    /// The model directory's path as oMLX loaded it.
    Path,
    /// The model id (the model's subdirectory name).
    Id,
}

/// How many window rows a compressed layer's rotating cache holds in a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowRows {
    /// MLX's raw rotating buffer: up to `sliding_window - 1` rows plus the last forward call's.
    Raw,
    /// The last `sliding_window` rows.
    Window,
}

impl OmlxFormat {
    pub const ALL: [OmlxFormat; 2] = [OmlxFormat::Upstream063, OmlxFormat::Fork070];

    pub fn name(self) -> &'static str {
        match self {
            OmlxFormat::Fork070 => "fork-0.7.0",
            OmlxFormat::Upstream063 => "upstream-0.6.3",
        }
    }

    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name).ok_or_else(|| {
            let known: Vec<_> = Self::ALL.iter().map(|f| f.name()).collect();
            CoreError::config("omlx_format", format!("{name:?} is not a supported oMLX block format (supported: {})", known.join(", ")))
        })
    }

    /// `omlx_cache_format_version` of the blocks this oMLX writes.
    pub fn write_version(self) -> &'static str {
        match self {
            OmlxFormat::Fork070 => "3",
            // Split payload layout (`gdn_ssd_split_enabled`, on by default): version 5.
            OmlxFormat::Upstream063 => "5",
        }
    }

    /// Format versions this oMLX reads (`_READABLE_CACHE_FORMAT_VERSIONS`).
    pub fn readable_versions(self) -> &'static [&'static str] {
        match self {
            OmlxFormat::Fork070 => &["2", "3"],
            OmlxFormat::Upstream063 => &["2", "3", "4", "5"],
        }
    }

    /// The `payload_layout` key and the cache signature's layout (None: no signature keys).
    pub fn payload_layout(self) -> Option<&'static str> {
        match self {
            OmlxFormat::Fork070 => None,
            OmlxFormat::Upstream063 => Some("split_recurrent_v1"),
        }
    }

    /// Whether blocks carry `block_size`, `cache_signature` and `payload_layout`.
    pub fn signed(self) -> bool {
        self.payload_layout().is_some()
    }

    pub fn pool_layout(self) -> PoolLayout {
        match self {
            OmlxFormat::Fork070 => PoolLayout::Full,
            OmlxFormat::Upstream063 => PoolLayout::Delta,
        }
    }

    pub fn overlap(self) -> Overlap {
        match self {
            OmlxFormat::Fork070 => Overlap::RestartPerCall,
            OmlxFormat::Upstream063 => Overlap::Carried,
        }
    }

    /// How the MLX this oMLX runs on sums the pooling products. A property of the MLX release;
    /// each supported oMLX pins (upstream) or was validated with (the fork) one.
    pub fn pool_sum(self) -> PoolSum {
        match self {
            OmlxFormat::Fork070 => PoolSum::F32,
            OmlxFormat::Upstream063 => PoolSum::Bf16,
        }
    }

    pub fn model_name_rule(self) -> ModelNameRule {
        match self {
            OmlxFormat::Fork070 => ModelNameRule::Path,
            OmlxFormat::Upstream063 => ModelNameRule::Id,
        }
    }

    /// Rows of a compressed layer's window in a block.
    pub fn window_rows(self) -> WindowRows {
        match self {
            OmlxFormat::Fork070 => WindowRows::Raw,
            OmlxFormat::Upstream063 => WindowRows::Window,
        }
    }

    /// Whether a state inside a `CacheList` is stamped with `_state_class_name`.
    pub fn class_names(self) -> bool {
        self.signed()
    }

    /// The block size oMLX picks for this model with an SSD cache: plain-KV models keep the
    /// default 256; a model with a rotating window aligns to a multiple of it in [512, 1024]
    /// (`_align_block_size_with_rotating_window`), a pooling model (DeepSeek-V4) upstream takes
    /// 2,048 (`_POOLING_ROTATING_BLOCK_SIZE`).
    pub fn block_size(self, plan: &ModelPlan) -> usize {
        match plan.sliding_window() {
            None => 256,
            Some(window) => {
                let (lo, hi) = match self {
                    OmlxFormat::Fork070 => (512, 1024),
                    OmlxFormat::Upstream063 => (2048, 2048),
                };
                let w = window.max(1);
                if w >= lo {
                    w
                } else {
                    let m = lo.div_ceil(w) * w;
                    if m > hi {
                        ((hi / w) * w).max(w)
                    } else {
                        m
                    }
                }
            }
        }
    }
}

impl std::fmt::Display for OmlxFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_say_what_is_supported() {
        for f in OmlxFormat::ALL {
            assert_eq!(OmlxFormat::from_name(f.name()).unwrap(), f);
        }
        let e = OmlxFormat::from_name("upstream-0.7.0").unwrap_err().to_string();
        assert!(e.contains("upstream-0.6.3") && e.contains("fork-0.7.0"), "{e}");
    }

    #[test]
    fn descriptors_differ_where_the_releases_do() {
        let (f, u) = (OmlxFormat::Fork070, OmlxFormat::Upstream063);
        assert_eq!((f.write_version(), u.write_version()), ("3", "5"));
        assert!(u.readable_versions().contains(&"4") && !f.readable_versions().contains(&"5"));
        assert_eq!((f.pool_layout(), u.pool_layout()), (PoolLayout::Full, PoolLayout::Delta));
        assert_eq!((f.overlap(), u.overlap()), (Overlap::RestartPerCall, Overlap::Carried));
        assert_eq!((f.model_name_rule(), u.model_name_rule()), (ModelNameRule::Path, ModelNameRule::Id));
        assert_eq!((f.pool_sum(), u.pool_sum()), (PoolSum::F32, PoolSum::Bf16));
    }
}
