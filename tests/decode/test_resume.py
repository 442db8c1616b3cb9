"""Multi-turn resume against a real oMLX (issue 13), through both wheels' bindings.

oMLX serves a prompt natively and stores its own blocks. The decode side reads the carry state
out of oMLX's OWN first block (``pd_bridge_omlx._native.carry_state``); the prefill side's capture
(``pd_bridge_vllm.Capture``) resumes from those bytes and is fed MLX's attention inputs from token
0 (rows before the resume point are ignored, as when vLLM recomputes from its own prefix-cache
end); a cache holding only oMLX's first block ingests the resumed stream over loopback TCP
(``BlockWriter.resume``). Every block it writes must be identical to the block oMLX wrote itself,
and the prompt is then served as a full hit with the native answer.
"""

from __future__ import annotations

import shutil
import threading

import pytest

pytestmark = pytest.mark.engine  # starts real `omlx serve` processes: not in the quick lane

import engines

engines.require("omlx", "pd_bridge_omlx")

import omlx_server  # noqa: E402
import bridge_blocks  # noqa: E402
from test_blocks import BRIDGE_ENV, OMLX, UPSTREAM, native, rescan  # noqa: E402,F401  (native: a fixture over conftest's)


def test_resumed_capture_continues_from_omlx_own_block(native, tmp_path):
    import parity
    import pd_bridge_omlx
    from pd_bridge_omlx import _native as omlx_native

    pd_bridge_vllm = engines.require("pd_bridge_vllm")
    from pd_bridge_vllm import _native as vllm_native

    model_dir = native.root / native.name
    block = native.block_size
    s = block  # the decoder holds block 0 (oMLX's own file); the capture resumes at its end
    hashes = omlx_server.block_hashes(native.model_name, native.ids, block)
    held = omlx_server.block_path(native.native_dir, hashes[0])
    decoder = pd_bridge_omlx.Weights.load(str(model_dir))

    if not UPSTREAM and native.name.startswith("tiny-v4"):
        # The fork's full-pool blocks cannot be continued from a carry state: refused by name.
        carry = omlx_native.carry_state(decoder, str(held), block, s, OMLX.omlx_format)
        writer = pd_bridge_omlx.BlockWriter(str(tmp_path / "c"), native.model_name, block, native.ids, OMLX.omlx_format)
        with pytest.raises(omlx_native.PdBridgeError, match="full-pool"):
            writer.resume(carry)
        return

    carry = omlx_native.carry_state(decoder, str(held), block, s, OMLX.omlx_format)
    if native.name.startswith("tiny-v4"):
        # A V4 block says where it ends (its window's offset); an MLA block does not, there the
        # carry state's chain hash ties it to its prefix (BlockWriter.resume checks it).
        with pytest.raises(omlx_native.PdBridgeError, match="position"):
            omlx_native.carry_state(decoder, str(held), block, 2 * s, OMLX.omlx_format)

    cache = tmp_path / "cache"
    dst = omlx_server.block_path(cache, hashes[0])
    dst.parent.mkdir(parents=True)
    shutil.copy2(held, dst)

    # MLX's attention inputs first: an unpulled capture is dropped after the server's pull timeout.
    cap_inputs = native.capture
    weights = pd_bridge_vllm.Weights.load(str(model_dir))
    server = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"shared-secret")
    secret = pd_bridge_omlx.capture_secret()
    digest = vllm_native.prompt_digest(list(native.ids))
    other_format = next(f for f in pd_bridge_omlx.omlx_formats() if f != OMLX.omlx_format)
    foreign = pd_bridge_vllm.Capture(weights, "req-x", len(native.ids), block, server, other_format)
    with pytest.raises(vllm_native.PdBridgeError, match="oMLX block format"):
        foreign.resume(carry)
    capture = pd_bridge_vllm.Capture(weights, "req-r", len(native.ids), block, server, OMLX.omlx_format, secret, digest)
    assert capture.resume(carry) == s and capture.resumed_at == s
    verdicts = []

    def prefill():
        for (start, _end), per_layer in zip(cap_inputs.steps, cap_inputs.inputs):
            for layer in range(weights.num_layers):
                capture.feed(layer, start, parity.bf16_bits(per_layer[layer]).tobytes())
        verdicts.append(capture.seal())

    with omlx_server.serve(native.root, cache, tmp_path / "home", model=native.name, extra_env=BRIDGE_ENV) as srv:
        writer = pd_bridge_omlx.BlockWriter(str(cache), srv.cache_model_name, block, native.ids, OMLX.omlx_format)
        assert writer.resume(carry) == 1
        producer = threading.Thread(target=prefill)
        producer.start()
        arrived = []
        blocks, verdict = pd_bridge_omlx.ingest(
            "127.0.0.1", server.port, b"shared-secret", "req-r", decoder.fingerprint,
            writer, on_block=lambda b: arrived.append(b.index), secret=secret, token_ids=list(native.ids),
        )
        producer.join()
        registered = rescan(srv)["registered"]
        r = omlx_server.complete(srv.base_url, srv.model, native.text, 8)

    assert arrived == list(range(1, native.n_blocks)) and blocks == native.n_blocks - 1
    assert '"verdict":"complete"' in verdict and verdicts and '"complete"' in verdicts[0]
    diff = bridge_blocks.BlockDiff()
    for i in arrived:
        bridge_blocks.compare_block(omlx_server.block_path(cache, hashes[i]), omlx_server.block_path(native.native_dir, hashes[i]), diff)
    print(f"\n{native.name} ({OMLX.key}): resumed at {s}, {diff.identical}/{diff.compared} blocks identical to oMLX's own")
    assert diff.compared == native.n_blocks - 1 >= 1
    assert diff.identical == diff.compared, diff.problems[:10]
    assert len(registered) == native.n_blocks - 1
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == native.n_blocks * block
    assert r["choices"][0]["text"] == native.answer
