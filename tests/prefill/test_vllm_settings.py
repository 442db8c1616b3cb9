"""Engine settings checked at start (prefix caching is accepted; pipeline and data parallelism
are refused), and the pointer
descriptor path into the native capture."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engines  # noqa: E402

vllm = engines.require("vllm")


def test_prefix_caching_is_accepted_and_captured_hits_are_capped():
    """Issue 13: vLLM's prefix cache may stay on; the cap on a captured request's hit installs on
    this vLLM's KVCacheManager (tests/e2e/test_multiturn.py shows the capped hit end to end)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from pd_bridge_vllm.connector import prefix_cap

    assert prefix_cap.install()
    assert getattr(KVCacheManager.get_computed_blocks, "_pd_bridge_capped", False)


def test_each_pipeline_stage_and_data_parallel_rank_finds_its_layers_and_port():
    """Pipeline stages each capture vLLM's partition of the layers, on a port of their own (base +
    rank x stages + stage), on vLLM's own ParallelConfig. Each data-parallel rank reads its rank
    from data_parallel_index, which a dense model's independent engines keep while their
    data_parallel_rank reads 0."""
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from pd_bridge_vllm.connector.metadata import data_parallel_rank, pipeline_stage, segment_port, stage_layers

    pc = ParallelConfig()
    pc.pipeline_parallel_size = 2
    # Outside vLLM's process groups (the scheduler process) the config says how many stages.
    assert pipeline_stage(SimpleNamespace(parallel_config=pc)) == (0, 2)
    # Each stage runs vLLM's own partition of the layers; every layer is on exactly one stage.
    for n, stages in ((3, 2), (43, 2), (61, 4), (3, 1)):
        ranges = [stage_layers(n, s, stages) for s in range(stages)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), ranges
    # Every data-parallel rank and stage of one host has its own segment port.
    ports = {segment_port(7188, r, s, 2) for r in range(3) for s in range(2)}
    assert ports == set(range(7188, 7194))
    pc = ParallelConfig()
    pc.data_parallel_size = 2
    assert data_parallel_rank(SimpleNamespace(parallel_config=pc)) == 0
    pc.data_parallel_index = 1
    assert data_parallel_rank(SimpleNamespace(parallel_config=pc)) == 1
    # Without the index (older releases): the rank.
    assert data_parallel_rank(SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=3))) == 3


def test_feed_ptr_equals_feed_bytes(tmp_path):
    """A CPU torch tensor handed over as (data_ptr, nbytes) gives the same capture as its bytes."""
    import torch

    import tiny_mla_hf
    from pd_bridge_vllm import Capture, SegmentServer, Weights

    _hf_dir, mlx_dir = tiny_mla_hf.build(tmp_path)
    w = Weights.load(str(mlx_dir))
    server = SegmentServer("127.0.0.1:0", b"t")
    torch.manual_seed(0)
    x = torch.randn(600, w.hidden_size).to(torch.bfloat16)
    a = Capture(w, "a", 600, 256, server)
    b = Capture(w, "b", 600, 256, server)
    for layer in range(w.num_layers):
        a.feed(layer, 0, x.view(torch.uint16).numpy().tobytes())
        b.feed_ptr(layer, 0, x.data_ptr(), x.numel() * x.element_size())
    assert json.loads(a.seal()) == json.loads(b.seal()) == {"verdict": "complete", "blocks": 2, "tokens": 512}
    with pytest.raises(Exception, match="aligned bf16"):
        Capture(w, "c", 600, 256, server).feed_ptr(0, 0, x.data_ptr() + 1, 10)


def test_piecewise_graphs_split_at_the_compiled_tap_and_whole_step_graphs_are_refused():
    """Under torch.compile the tap is the custom op ``pd_bridge::attention_input``; a CUDA graph
    would freeze it. vLLM's own config, as vLLM fills it in, gets the op among its splitting ops
    (default list and a user's explicit one alike); whole-step graphs for prompt steps
    (``cudagraph_mode=FULL``) and a piecewise config without the op are refused at start."""
    import inspect
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

    from pd_bridge_vllm import tap
    from pd_bridge_vllm.connector import UnsupportedEngineSettings, check_compilation

    tap.split_at_tap()
    assert not tap.split_at_tap()  # idempotent
    args = {"all2all_backend": "naive"} if "all2all_backend" in inspect.signature(CompilationConfig.set_splitting_ops_for_v1).parameters else {}
    for explicit in (None, ["vllm::unified_attention_with_output"]):
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=explicit)
        cc.set_splitting_ops_for_v1(**args)
        assert tap.OP_NAME in cc.splitting_ops, cc.splitting_ops
        assert cc.splitting_ops.count(tap.OP_NAME) == 1
        cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        check_compilation(SimpleNamespace(compilation_config=cc), tap.OP_NAME)
    cc = CompilationConfig(mode=CompilationMode.NONE)
    cc.set_splitting_ops_for_v1(**args)
    assert tap.OP_NAME not in (cc.splitting_ops or [])  # nothing compiled: nothing to split
    for mode in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
        cc.cudagraph_mode = mode
        check_compilation(SimpleNamespace(compilation_config=cc), tap.OP_NAME)
    cc.cudagraph_mode = CUDAGraphMode.FULL
    with pytest.raises(UnsupportedEngineSettings, match="cudagraph_mode=FULL replays prompt steps as whole CUDA graphs"):
        check_compilation(SimpleNamespace(compilation_config=cc), tap.OP_NAME)
    # Piecewise graphs without torch.compile are breakable stream captures: the eager tap breaks them.
    cc = SimpleNamespace(mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, splitting_ops=[])
    check_compilation(SimpleNamespace(compilation_config=cc), tap.OP_NAME)
    cc = SimpleNamespace(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE, splitting_ops=["vllm::unified_attention_with_output"])
    with pytest.raises(UnsupportedEngineSettings, match=r"pd_bridge::attention_input is not in compilation_config.splitting_ops"):
        check_compilation(SimpleNamespace(compilation_config=cc), tap.OP_NAME)
