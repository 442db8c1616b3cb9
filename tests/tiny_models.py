"""Tiny random decoder models, written as MLX model directories that oMLX and mlx-lm load.

The models are built from the real MLX model classes (oMLX's DeepSeek-V4, mlx-lm's
DeepSeek-V3), randomised, quantized the way the real checkpoints are (routed experts MXFP4,
optionally attention MXFP8), and saved with a config.json that `mlx_lm.utils.load_model` reads
back — so every test loads them exactly as the engines do.

Run as a script to (re)generate them: ``python tests/tiny_models.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

# A handful of layers covering every DeepSeek-V4 cache kind: ratio 0 (window only), 4 (window,
# overlapped pool, indexer pool) and 128 (window, simple pool).
V4_CONFIG = {
    "model_type": "deepseek_v4",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 64,
    "head_dim": 128,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_topk": 16,
    "sliding_window": 128,
    "compress_ratios": [0, 0, 4, 128, 4, 0],
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "hc_mult": 4,
    "num_hash_layers": 1,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}

# DeepSeek-V3-style MLA with the real cache dims (latent 512, rope 64); dense MLPs so the CPU
# needs no MoE kernels.
MLA_CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "tie_word_embeddings": False,
}

MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
MXFP8 = {"group_size": 32, "bits": 8, "mode": "mxfp8"}


def _apply_v4_patch() -> None:
    from omlx.patches.deepseek_v4 import apply_deepseek_v4_patch

    apply_deepseek_v4_patch()


def _randomize(model: nn.Module, seed: int, keep_f32) -> None:
    """Random values with realistic scales; dtypes as the real checkpoints keep them."""
    mx.random.seed(seed)

    def fill(path: str, p: mx.array) -> mx.array:
        if not mx.issubdtype(p.dtype, mx.floating):
            if path.endswith("tid2eid"):
                return mx.random.randint(0, model.args.n_routed_experts, p.shape).astype(p.dtype)
            return p
        if ".hc_" in path or "_hc." in path or "hc_head" in path or path.endswith("e_score_correction_bias"):
            return p  # hyper-connection mixing and router bias: keep the model's own init
        if path.endswith("norm.weight") or path.endswith("layernorm.weight"):
            v = 1.0 + 0.1 * mx.random.normal(p.shape)
        elif path.endswith(".ape"):
            v = 0.5 * mx.random.normal(p.shape)
        elif path.endswith("attn_sink"):
            v = 0.1 * mx.random.normal(p.shape)
        elif p.ndim >= 2:
            v = mx.random.normal(p.shape) * (p.shape[-1] ** -0.5)
        else:
            v = 0.1 * mx.random.normal(p.shape)
        dtype = mx.float32 if (keep_f32(path) or path.endswith(".ape")) else mx.bfloat16
        return v.astype(dtype)

    model.update(tree_map_with_path(lambda path, p: fill(path, p), model.parameters()))


def _quantize(model: nn.Module, per_path: dict[str, dict]) -> None:
    def predicate(path, module):
        return per_path.get(path, False) if hasattr(module, "to_quantized") else False

    nn.quantize(model, class_predicate=predicate)


def _save(model: nn.Module, config: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def make_v4(out: Path, attention: str = "bf16", seed: int = 0) -> Path:
    """A tiny DeepSeek-V4: experts MXFP4 (MLX's CPU has no bf16 gather_mm); attention
    projections bf16 or MXFP8 as in the real checkpoint."""
    _apply_v4_patch()
    from mlx_lm.models import deepseek_v4 as dv4

    config = dict(V4_CONFIG)
    model = dv4.Model(dv4.ModelArgs.from_dict(config))
    keep = model.cast_predicate
    _randomize(model, seed, lambda path: not keep(path))
    per_path: dict[str, dict] = {}
    for path, module in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if ".ffn.switch_mlp." in path and path.endswith("_proj"):
            per_path[path] = MXFP4
        elif attention == "mxfp8" and (".attn.w" in path or ".attn.indexer.wq" in path):
            per_path[path] = MXFP8
    _quantize(model, per_path)
    config["quantization"] = {**MXFP4, **per_path}
    return _save(model, config, out)


def make_mla(out: Path, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3-style MLA model (bf16)."""
    from mlx_lm.models import deepseek_v3 as dv3

    config = dict(MLA_CONFIG)
    model = dv3.Model(dv3.ModelArgs.from_dict(config))
    _randomize(model, seed, lambda path: path.endswith("e_score_correction_bias"))
    return _save(model, config, out)


def load(model_dir: Path):
    """Load a model directory exactly as oMLX does."""
    _apply_v4_patch()
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    return model


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".pd-bridge/models")
    print(make_v4(root / "tiny-v4-bf16"))
    print(make_v4(root / "tiny-v4-mxfp8", attention="mxfp8"))
    print(make_mla(root / "tiny-mla"))
