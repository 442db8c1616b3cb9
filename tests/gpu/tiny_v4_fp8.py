"""A tiny random DeepSeek-V4 that vLLM 0.26.0 serves on an H200, plus the decoder's weights dir,
from ONE set of tensors.

``build(out)`` writes

- ``out/hf``: DeepSeek's own checkpoint layout (``layers.N.attn.wkv.weight`` + ``.scale`` ...) as
  vLLM 0.26.0's CUDA V4 path needs it: every linear vLLM builds with the quant config is block-FP8
  (e4m3, 128x128 blocks: attn wq_a / wkv / wq_b / wo_a / wo_b, indexer.wq_b, experts); the
  compressors, norms, router, hc_* and attn_sink stay bf16/f32. head_dim 512 / rope 64 (FlashMLA's
  fp8_ds_mla cache), index head 128 with 64 heads and top-k 512, every quantized dimension a
  multiple of 128. Serve it with ``kv_cache_dtype="fp8"``.
- ``out/mlx``: what ``pd_bridge_vllm.Weights.load`` reads (MLX naming, bf16): each layer's
  ``model.layers.N.attn.wkv.weight`` / ``kv_norm.weight`` and its compressors. The FP8 scales are
  powers of two, so the decoder's bf16 ``wkv`` is EXACTLY vLLM's dequantized e4m3 weight; the
  compressor tensors are the same bf16/f32 tensors in both.

Shapes follow the vLLM CUDA kit's reference generator (``make_tiny_v4.py``, "small" preset).
Deterministic for a seed. ``python tiny_v4_fp8.py OUT_DIR [SEED]``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

BLOCK = 128
CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "vocab_size": 1024,
    "hidden_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1048576,
    "sliding_window": 128,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    # per layer + the (absent) MTP layer: window-only, window-only, C4A (indexer), C128A, C4A
    "compress_ratios": [0, 0, 4, 128, 4, 0],
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "num_hash_layers": 1,
    "num_nextn_predict_layers": 1,
    "expert_dtype": "fp8",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]},
}
# What the decoder's plan reads (core/src/plan.rs), the same values vLLM gets.
DECODER_KEYS = ("hidden_size", "num_hidden_layers", "head_dim", "qk_rope_head_dim", "index_head_dim", "sliding_window",
                "compress_ratios", "rope_theta", "compress_rope_theta", "rope_scaling", "rms_norm_eps", "vocab_size")


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nh, hd = cfg["num_attention_heads"], cfg["head_dim"]
    ql, ol, g, hc = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"], cfg["hc_mult"]
    mix = (2 + hc) * hc
    E, inter, k = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["num_experts_per_tok"]
    shared = inter * cfg["n_shared_experts"]
    ih, ihd = cfg["index_n_heads"], cfg["index_head_dim"]
    S = [("embed.weight", (v, h), "bf16"), ("head.weight", (v, h), "bf16"), ("norm.weight", (h,), "norm"),
         ("hc_head_fn", (hc, hc * h), "hc"), ("hc_head_base", (hc,), "hc"), ("hc_head_scale", (1,), "hc")]
    for i in range(cfg["num_hidden_layers"]):
        p, ratio = f"layers.{i}", max(1, cfg["compress_ratios"][i])
        S += [(f"{p}.attn_norm.weight", (h,), "norm"), (f"{p}.ffn_norm.weight", (h,), "norm")]
        for part in ("attn", "ffn"):
            S += [(f"{p}.hc_{part}_fn", (mix, hc * h), "hc"), (f"{p}.hc_{part}_base", (mix,), "hc"), (f"{p}.hc_{part}_scale", (3,), "hc")]
        a = f"{p}.attn"
        S += [(f"{a}.wq_a.weight", (ql, h), "fp8"), (f"{a}.wkv.weight", (hd, h), "fp8"), (f"{a}.q_norm.weight", (ql,), "norm"),
              (f"{a}.kv_norm.weight", (hd,), "norm"), (f"{a}.wq_b.weight", (nh * hd, ql), "fp8"),
              (f"{a}.wo_a.weight", (g * ol, nh * hd // g), "fp8"), (f"{a}.wo_b.weight", (h, g * ol), "fp8"), (f"{a}.attn_sink", (nh,), "sink")]
        if ratio > 1:
            coff, c = (2 if ratio == 4 else 1), f"{a}.compressor"
            S += [(f"{c}.wkv.weight", (coff * hd, h), "bf16"), (f"{c}.wgate.weight", (coff * hd, h), "bf16"),
                  (f"{c}.norm.weight", (hd,), "norm"), (f"{c}.ape", (ratio, coff * hd), "ape")]
        if ratio == 4:
            x = f"{a}.indexer"
            S += [(f"{x}.wq_b.weight", (ih * ihd, ql), "fp8"), (f"{x}.weights_proj.weight", (ih, h), "bf16"),
                  (f"{x}.compressor.wkv.weight", (2 * ihd, h), "bf16"), (f"{x}.compressor.wgate.weight", (2 * ihd, h), "bf16"),
                  (f"{x}.compressor.norm.weight", (ihd,), "norm"), (f"{x}.compressor.ape", (4, 2 * ihd), "ape")]
        f = f"{p}.ffn"
        S += [(f"{f}.gate.weight", (E, h), "bf16")]
        S += [(f"{f}.gate.tid2eid", (v, k), "idx")] if i < cfg["num_hash_layers"] else [(f"{f}.gate.bias", (E,), "bias")]
        for e in range(E):
            S += [(f"{f}.experts.{e}.w1.weight", (inter, h), "fp8"), (f"{f}.experts.{e}.w3.weight", (inter, h), "fp8"),
                  (f"{f}.experts.{e}.w2.weight", (h, inter), "fp8")]
        S += [(f"{f}.shared_experts.w1.weight", (shared, h), "fp8"), (f"{f}.shared_experts.w3.weight", (shared, h), "fp8"),
              (f"{f}.shared_experts.w2.weight", (h, shared), "fp8")]
    return S


def quant_fp8_pow2(w):
    """[N, K] -> (e4m3 q, float32 scale_inv [N/128, K/128]) with power-of-two scales, so that
    q.float() * scale is exactly representable in bf16 (3-bit mantissa times 2^k)."""
    import torch

    N, K = w.shape
    nb, kb = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
    wp = torch.zeros(nb * BLOCK, kb * BLOCK, device=w.device)
    wp[:N, :K] = w
    blocks = wp.view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (blocks / s[:, None, :, None]).clamp(-448, 448).view(nb * BLOCK, kb * BLOCK)[:N, :K].to(torch.float8_e4m3fn)
    return q.contiguous(), s.float().contiguous()


def dequant(q, s):
    import torch

    N, K = q.shape
    full = s.repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :K]
    w = q.float() * full
    b = w.to(torch.bfloat16)
    assert torch.equal(b.float(), w), "power-of-two FP8 dequantization is not exact in bf16"
    return b


# DeepSeek-V4-Flash's attention (43 layers, hidden 4096, 64 heads of 512, q/o LoRA 1024 in 8 groups,
# index head 128, Flash's compress ratios) with a MoE small enough to fit: for the benchmark.
FLASH_ATTENTION = {
    "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "q_lora_rank": 1024, "o_lora_rank": 1024,
    "o_groups": 8, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "n_routed_experts": 4, "moe_intermediate_size": 256,
}


def build(out: Path, seed: int = 0, overrides: dict | None = None, device: str = "cpu") -> tuple[Path, Path]:
    """``overrides``: config keys to change (e.g. ``FLASH_ATTENTION``); ``device``: where the random
    tensors are made (a GPU makes the Flash-sized checkpoint in seconds)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads(json.dumps({**CONFIG, **(overrides or {})}))
    out = Path(out)
    hf_dir, mlx_dir = out / "hf", out / "mlx"
    hf_dir.mkdir(parents=True, exist_ok=True)
    mlx_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32, device=device)

    hf, dec = {}, {}
    for name, shape, kind in tensor_specs(cfg):
        if kind == "fp8":
            q, s = quant_fp8_pow2(randn(shape) * shape[-1] ** -0.5)
            hf[name], hf[name[: -len(".weight")] + ".scale"] = q, s
            t = None if not name.endswith("attn.wkv.weight") else dequant(q, s)
        elif kind == "bf16":
            t = hf[name] = (randn(shape) * shape[-1] ** -0.5).to(torch.bfloat16)
        elif kind == "norm":
            t = hf[name] = (1.0 + 0.1 * randn(shape)).to(torch.bfloat16)
        elif kind == "hc":
            t = hf[name] = ((1.0 if name.endswith("_scale") else 0.0) + 0.02 * randn(shape)).float()
        elif kind == "ape":
            t = hf[name] = (0.5 * randn(shape)).float()
        elif kind in ("sink", "bias"):
            t = hf[name] = ((0.1 if kind == "sink" else 0.01) * randn(shape)).float()
        elif kind == "idx":
            t = hf[name] = torch.randint(0, cfg["n_routed_experts"], shape, generator=gen, dtype=torch.int64, device=device).to(torch.int32)
        else:
            raise AssertionError(kind)
        # The decoder's view: each layer's attention-cache tensors, MLX-named.
        if t is not None and ".attn." in name and ".indexer.wq_b" not in name and ".indexer.weights_proj" not in name:
            leaf = name.split(".attn.", 1)[1]
            if leaf.startswith(("wkv.", "kv_norm.", "compressor.", "indexer.compressor.")):
                dec["model." + name] = t.contiguous().clone()
    save_file({k: v.contiguous().cpu() for k, v in hf.items()}, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    (hf_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    (hf_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    save_file({k: v.cpu() for k, v in dec.items()}, str(mlx_dir / "model.safetensors"), metadata={"format": "mlx"})
    (mlx_dir / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **{k: cfg[k] for k in DECODER_KEYS}}, indent=1))
    return hf_dir, mlx_dir


if __name__ == "__main__":
    print(*build(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0))
