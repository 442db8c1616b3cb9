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
    from types import SimpleNamespace

    from vllm.config import CacheConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from pd_bridge_vllm.connector import check_engine_settings, prefix_cap

    check_engine_settings(SimpleNamespace(cache_config=CacheConfig(enable_prefix_caching=True)))
    check_engine_settings(SimpleNamespace(cache_config=CacheConfig(enable_prefix_caching=False)))
    assert prefix_cap.install()
    assert getattr(KVCacheManager.get_computed_blocks, "_pd_bridge_capped", False)


def test_pipeline_and_data_parallelism_are_refused_naming_the_setting():
    """Pipeline stages see only their own layers and data-parallel engines would each bind the
    segment port: refused at start with the setting named, on vLLM's own ParallelConfig."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig, ParallelConfig

    from pd_bridge_vllm.connector import check_engine_settings

    cache = CacheConfig(enable_prefix_caching=True)
    check_engine_settings(SimpleNamespace(cache_config=cache, parallel_config=ParallelConfig(tensor_parallel_size=2)))
    for name in ("pipeline_parallel_size", "data_parallel_size"):
        pc = ParallelConfig()
        setattr(pc, name, 2)
        with pytest.raises(ValueError, match=f"{name}=2 is not supported"):
            check_engine_settings(SimpleNamespace(cache_config=cache, parallel_config=pc))


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
