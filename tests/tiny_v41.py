"""A tiny random DeepSeek-V4.1 model, written as an MLX model directory mlx-lm loads.

Built from mlx-lm's own ``deepseek_v41`` classes (mlx-lm 0.32.2 or later), randomised like the
other tiny models (``tiny_models._randomize``: the compressors, hyper-connections, sinks and router
bias stay float32 as the model's ``cast_predicate`` keeps them), routed experts MXFP4 and the grouped output projection
MXFP8 (MLX's CPU has no bf16 ``gather_mm``), and saved with a config.json ``mlx_lm.utils.load_model`` reads back.

The layers cover every kind of V4.1 cache (the real V4.1-Flash: ratios ``[0,0] + [2]*18 + [1]*20``,
KV sources ``[2, 8, 14, 20]``, index sources ``[2, 8, 14, 20, 24, 28, 32, 36]``):

    layer  ratio  KV source  index source   its cache
    0      0      -          -              window (base theta, no YaRN)
    1      2      yes        yes            window, compress_kv, index_k, pending kv/gate
    2      2      -          -              window (reads layer 1's pools)
    3      2      -          yes            window (scores layer 1's index keys)
    4      1      yes        yes            window, compress_kv, index_k (candidate source)
    5      1      -          yes            window
    6      1      -          -              window
    7      1      yes        -              window, compress_kv

Run as a script: ``python tests/tiny_v41.py OUT_DIR`` writes ``OUT_DIR/tiny-v41`` and
``OUT_DIR/tiny-v41-mxfp8`` (the window projections MXFP8).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_models  # noqa: E402

NAME = "tiny-v41"
NAME_MXFP8 = "tiny-v41-mxfp8"

V41_CONFIG = {
    "model_type": "deepseek_v41",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "head_dim": 512,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "moe_intermediate_size": 128,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "sliding_window": 128,
    # One more entry than layers: the real config lists its MTP layers too.
    "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0],
    "kv_source_layer_ids": [1, 4, 7],
    "index_source_layer_ids": [1, 3, 4, 5],
    "compress_rope_theta": 160000.0,
    "candidate_source_layer_id": 4,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 8,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 16,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_layer_ids": [],
    "tie_word_embeddings": False,
}


def make_v41(out: Path, seed: int = 0, config: dict | None = None, attention: str = "bf16") -> Path:
    """A tiny DeepSeek-V4.1 (needs mlx-lm's ``deepseek_v41``, mlx-lm 0.32.2 or later); the window
    projections ``self_attn.kv_proj`` bf16 or MXFP8 (the real checkpoint's wkv is fp8)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import deepseek_v41 as dv41

    config = dict(config or V41_CONFIG)
    model = dv41.Model(dv41.ModelArgs.from_dict(config))
    keep = model.cast_predicate
    tiny_models._randomize(model, seed, lambda path: not keep(path))
    per_path: dict[str, dict] = {}
    for path, _module in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if ".experts.switch_mlp." in path and path.endswith("_proj"):
            per_path[path] = tiny_models.MXFP4
        elif attention == "mxfp8" and path.endswith(".self_attn.kv_proj"):
            per_path[path] = tiny_models.MXFP8
        elif path.endswith(".self_attn.o_a_proj"):
            # A SwitchLinear after the attention (no cache math): MLX's CPU gather_mm is
            # float32-only, its gather_qmm is not. The real checkpoint's wo_a is fp8 too.
            per_path[path] = tiny_models.MXFP8
    tiny_models._quantize(model, per_path)
    config["quantization"] = {**tiny_models.MXFP4, **per_path}
    return tiny_models._save(model, config, out)


def load(model_dir: Path):
    """Load a model directory as mlx-lm does (no oMLX patches: oMLX has no V4.1 here)."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    return model


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".pd-bridge/models")
    print(make_v41(root / NAME))
    print(make_v41(root / NAME_MXFP8, attention="mxfp8"))
