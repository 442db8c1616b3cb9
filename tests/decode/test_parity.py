"""The core's cache math against MLX's own caches, on tiny random models (issue: foundation).

Runs against whichever oMLX is installed (its DeepSeek-V4 model and overlap semantics, named by
``pd_bridge_omlx.versions``). The fork: a 2,777-token prompt in 512-token decoder steps (its
ratio-4 overlap restarts at each call, so the core takes that grid). Upstream: a 4,873-token
prompt (two 2,048-token blocks and an odd tail) in 1,111-token forward calls, which cut windows
mid-way — its overlap carries across calls, so any chunking must give the same state. Each run
feeds the captured attention inputs to the core and compares every cache array after every
step, plus once more after re-cutting the prompt into random chunks.
"""

import pytest

import parity

UPSTREAM = parity.omlx_format().startswith("upstream")
V4_TOKENS, V4_STEP = (2 * 2048 + 777, 1111) if UPSTREAM else (parity.PROMPT_TOKENS, parity.DECODER_STEP)


@pytest.fixture(scope="module")
def v4_bf16(models):
    return parity.run_v4(models / "tiny-v4-bf16", n_tokens=V4_TOKENS, step=V4_STEP)


def report(r):
    print("\n" + r.tally.line(r.name))
    for m in r.tally.mismatched[:10]:
        print("    " + m)


def test_deepseek_v4_bf16_is_bit_exact(v4_bf16):
    report(v4_bf16)
    t = v4_bf16.tally
    # 5 layers: 5 windows + 3 pools x3 arrays + 2 indexer pools x3, minus empty remainders,
    # after each of 6 steps and once re-chunked.
    assert t.arrays >= 80
    assert t.bit_exact, t.mismatched[:10]


def test_every_cache_array_is_compared(v4_bf16):
    # The prompt length is not a multiple of 4 or 128, so the remainder buffers are compared too;
    # upstream's PoolingCache also holds the carried previous ratio-4 window.
    names = {"window", "pooled", "buf_kv", "buf_gate", "idx_pooled", "idx_buf_kv", "idx_buf_gate"}
    if UPSTREAM:
        names |= {"prev_kv", "prev_gate", "idx_prev_kv", "idx_prev_gate"}
    assert v4_bf16.tally.names == names


def test_deepseek_v4_mxfp8_quantized_forward_is_bit_exact(models):
    """MLX's own forward, its CPU `quantized_matmul` included (bf16 group sums, then scaled)."""
    r = parity.run_v4(models / "tiny-v4-mxfp8", n_tokens=V4_TOKENS, step=V4_STEP)
    report(r)
    assert r.tally.arrays >= 80
    assert r.tally.bit_exact, r.tally.mismatched[:10]


def test_mla_is_bit_exact(models):
    r = parity.run_mla(models / "tiny-mla")
    report(r)
    assert r.tally.arrays >= 40
    assert r.tally.bit_exact, r.tally.mismatched[:10]
