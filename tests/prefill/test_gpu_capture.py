"""The capture engine's GPU path driven with torch CUDA tensors exactly as the vLLM tap passes
them (pointer, byte length, dtype, device index, torch's current stream) while other work runs
on that stream: the sealed segments must equal the CPU path's (same digest over every segment
and the same seal). Needs torch with CUDA and a GPU: skipped, with the reason, everywhere else
(CI's prefill venv has CPU torch). Rerun on a GPU host with tests/gpu/run.sh.
"""

import json

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this venv")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: the GPU capture path runs on a GPU host (tests/gpu/run.sh)", allow_module_level=True)

from safetensors.torch import save_file  # noqa: E402

import pd_bridge_vllm  # noqa: E402

HIDDEN = 256


def _v4_dir(tmp_path, seed=0):
    g = torch.Generator().manual_seed(seed)
    ratios = [0, 4, 128, 4]
    head, index_head = 64, 32
    cfg = {
        "model_type": "deepseek_v4",
        "hidden_size": HIDDEN,
        "num_hidden_layers": len(ratios),
        "head_dim": head,
        "qk_rope_head_dim": 16,
        "index_head_dim": index_head,
        "sliding_window": 16,
        "compress_ratios": ratios,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    }
    t = {}

    def lin(name, out, inp):
        t[name] = (torch.randn(out, inp, generator=g) * inp**-0.5).to(torch.bfloat16)

    for i, r in enumerate(ratios):
        p = f"model.layers.{i}.attn"
        lin(f"{p}.wkv.weight", head, HIDDEN)
        t[f"{p}.kv_norm.weight"] = (1 + 0.1 * torch.randn(head, generator=g)).to(torch.bfloat16)
        comps = [] if r == 0 else [(f"{p}.compressor", head)] + ([(f"{p}.indexer.compressor", index_head)] if r == 4 else [])
        for c, hd in comps:
            od = 2 * hd if r == 4 else hd
            lin(f"{c}.wkv.weight", od, HIDDEN)
            lin(f"{c}.wgate.weight", od, HIDDEN)
            t[f"{c}.ape"] = 0.5 * torch.randn(r, od, generator=g)
            t[f"{c}.norm.weight"] = (1 + 0.1 * torch.randn(hd, generator=g)).to(torch.bfloat16)
    d = tmp_path / f"v4-{seed}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(d / "model.safetensors"))
    return d


def _mla_dir(tmp_path, seed=1):
    g = torch.Generator().manual_seed(seed)
    cfg = {
        "model_type": "deepseek_v3",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 3,
        "kv_lora_rank": 128,
        "qk_rope_head_dim": 32,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1.0},
    }
    t = {}
    for i in range(3):
        p = f"model.layers.{i}.self_attn"
        t[f"{p}.kv_a_proj_with_mqa.weight"] = (torch.randn(160, HIDDEN, generator=g) * 0.1).to(torch.bfloat16)
        t[f"{p}.kv_a_layernorm.weight"] = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    d = tmp_path / f"mla-{seed}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(d / "model.safetensors"))
    return d


def _chunks(tokens, sizes):
    out, s, i = [], 0, 0
    while s < tokens:
        n = min(sizes[i % len(sizes)], tokens - s)
        out.append((s, n))
        s, i = s + n, i + 1
    return out


@pytest.mark.parametrize("family", ["v4", "mla"])
def test_cuda_tensors_capture_equals_cpu_path(tmp_path, monkeypatch, family):
    monkeypatch.setenv("PD_BRIDGE_GPU_GEMM", "exact")  # bit-exact projections: segments must be identical
    model = _v4_dir(tmp_path) if family == "v4" else _mla_dir(tmp_path)
    w = pd_bridge_vllm.Weights.load(str(model))
    # One server per capture: both captures carry the same request id, so their segment headers
    # (and so the digests) can be equal.
    servers = [pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"test-token") for _ in range(2)]
    tokens, block = (1300, 256) if family == "v4" else (700, 64)
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(7)
    xs = [torch.randn(tokens, HIDDEN, device=dev, generator=gen).to(torch.bfloat16) for _ in range(w.num_layers)]

    # The CPU path: host rows through feed_ptr.
    cpu = pd_bridge_vllm.Capture(w, "req", tokens, block, servers[0])
    for s, n in _chunks(tokens, [tokens]):
        for layer, x in enumerate(xs):
            h = x[s : s + n].cpu().contiguous()
            cpu.feed_ptr(layer, s, h.data_ptr(), h.numel() * h.element_size())
    cpu_seal = json.loads(cpu.seal())
    cpu_digest = cpu.segments_digest
    assert cpu_digest[0] == tokens // block

    # The GPU path, as the tap drives it: each layer's input is a fresh tensor made on torch's
    # current stream behind unrelated work, fed by descriptor, then dropped (record_stream keeps
    # its memory from being reused before the side stream has read it); more work follows.
    gpu = pd_bridge_vllm.Capture(w, "req", tokens, block, servers[1])
    big = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    for s, n in _chunks(tokens, [300, 77, 512]):
        for layer, x in enumerate(xs):
            busy = big @ big  # other work queued on torch's stream ahead of the input
            xc = (x[s : s + n] + busy[:1, :1] * 0).to(torch.bfloat16).contiguous()
            cur = torch.cuda.current_stream(dev)
            gpu.feed_cuda(layer, s, xc.data_ptr(), xc.numel() * xc.element_size(), "bfloat16", xc.device.index, cur.cuda_stream)
            side = gpu.side_stream
            assert side is not None, "the GPU backend did not start"
            xc.record_stream(torch.cuda.ExternalStream(side, device=dev))
            del xc
            junk = torch.empty(n, HIDDEN, device=dev, dtype=torch.bfloat16).fill_(float("nan"))  # may reuse freed memory
            del junk, busy
        gpu.poll()  # event queries only
    gpu_seal = json.loads(gpu.seal())
    assert gpu.pending == 0
    assert gpu_seal == cpu_seal
    assert gpu.segments_digest == cpu_digest, "GPU-path segments differ from the CPU path's"
    print(f"{family}: {cpu_digest[0]} segments, identical on the GPU and CPU paths ({torch.cuda.get_device_name(dev)})")


def test_a_prepared_device_allocates_nothing_during_captures(tmp_path):
    """prepare_gpu (the connector calls it at engine start) fills the pools a capture draws its
    block bodies from: captures of the prepared shape then allocate and pin nothing, a second
    prepare finds the pools full, and a block size the GPU path does not take is declined."""
    from pd_bridge_vllm._native import gpu_capture_times, prepare_gpu

    w = pd_bridge_vllm.Weights.load(str(_v4_dir(tmp_path)))
    fmt, block, step = "upstream-0.6.3", 256, 512
    got = prepare_gpu(w, 0, fmt, step, block, captures=2, held_bytes=0)
    assert got["declined"] is None, got
    in_flight = 2 * (step // block + 2)
    assert got["staging_bodies"] == 2 * in_flight and got["pinned_bodies"] == 2 * in_flight, got
    assert got["staging_bytes"] == got["staging_bodies"] * got["body_bytes"] > 0, got
    again = prepare_gpu(w, 0, fmt, step, block, captures=2, held_bytes=0)
    assert again["allocated"] == 0, f"the pools were full, yet preparing again allocated: {again}"

    dev = torch.device("cuda", 0)
    tokens = 1300
    gen = torch.Generator(device=dev).manual_seed(3)
    xs = [torch.randn(tokens, HIDDEN, device=dev, generator=gen).to(torch.bfloat16) for _ in range(w.num_layers)]
    gpu_capture_times(True)
    servers = [pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"test-token") for _ in range(2)]
    caps = [pd_bridge_vllm.Capture(w, f"req{i}", tokens, block, servers[i], fmt) for i in range(2)]
    for s, n in _chunks(tokens, [step]):  # two captures at once, as the pools were sized for
        for cap in caps:
            for layer, x in enumerate(xs):
                xc = x[s : s + n].contiguous()
                cap.feed_cuda(layer, s, xc.data_ptr(), xc.numel() * xc.element_size(), "bfloat16", 0, torch.cuda.current_stream(dev).cuda_stream)
                xc.record_stream(torch.cuda.ExternalStream(cap.side_stream, device=dev))
    seals = [json.loads(cap.seal()) for cap in caps]
    assert all(x["verdict"] == "complete" and x["blocks"] == tokens // block for x in seals), seals
    new = gpu_capture_times(True).get("new_buffers")
    assert new == 0, f"captures of the prepared shape allocated {new} buffers"

    odd = prepare_gpu(w, 0, fmt, step, 250, captures=1)
    assert odd["declined"] and "250-token blocks" in odd["declined"], odd
    print(f"prepared: {got}; two captures allocated nothing")


def test_a_tensor_recorded_on_a_dropped_captures_stream_frees_cleanly(tmp_path):
    """torch records an event on every stream a tensor was `record_stream`ed on when it frees
    the tensor, which in vLLM may be after the capture is gone (a request aborted mid-prompt).
    The side stream is lent by the device, not destroyed with the capture: freeing such a tensor
    afterwards must neither fail nor abort the process (it did: "context is destroyed")."""
    import gc

    w = pd_bridge_vllm.Weights.load(str(_v4_dir(tmp_path)))
    dev = torch.device("cuda", 0)
    server = pd_bridge_vllm.SegmentServer("127.0.0.1:0", b"test-token")
    tokens, block = 512, 256
    xs = [torch.randn(tokens, HIDDEN, device=dev).to(torch.bfloat16) for _ in range(w.num_layers)]
    cap = pd_bridge_vllm.Capture(w, "dropped", tokens, block, server, "upstream-0.6.3")
    handle = None
    for layer, x in enumerate(xs):
        cap.feed_cuda(layer, 0, x.data_ptr(), x.numel() * x.element_size(), "bfloat16", 0, torch.cuda.current_stream(dev).cuda_stream)
        handle = cap.side_stream  # the GPU path opens at the first feed
        assert handle is not None, "the GPU path was not used"
        x.record_stream(torch.cuda.ExternalStream(handle, device=dev))
    del cap
    gc.collect()
    del xs, x  # torch now records its free events on the dropped capture's stream
    gc.collect()
    torch.cuda.synchronize(dev)
    again = pd_bridge_vllm.Capture(w, "after", tokens, block, server, "upstream-0.6.3")
    x = torch.randn(tokens, HIDDEN, device=dev).to(torch.bfloat16)
    again.feed_cuda(0, 0, x.data_ptr(), x.numel() * x.element_size(), "bfloat16", 0, torch.cuda.current_stream(dev).cuda_stream)
    assert again.side_stream == handle, "the next capture should reuse the idle side stream"
    del again, x
    torch.cuda.synchronize(dev)
    print("a tensor freed after its capture was dropped: clean; the stream was lent again")
