"""One compact vLLM engine run with the plugin and the connector, for the release tests
(``test_vllm_releases.py``) and the pipeline-parallel one (``test_vllm_pipeline.py``).

Run as ``python engine_driver.py WORK`` in the interpreter of the vLLM under test, with
``WORK/spec.json`` saying the model (``hf_dir``, ``mlx_dir``), the segment port, extra ``LLM``
arguments (``engine``) and the pipeline stages to pull (``stages``): it serves the tiny MLA model,
prefills one captured prompt beside an uncaptured one (and, with stages, a capture that does not
name them), pulls the capture with the decode side's client, asks vLLM for its metrics and writes
``WORK/result.json``. The tests decide.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import tiny_mla_hf  # noqa: E402

TOKEN = "test-token"
SECRET = "6a" * 32
BLOCK = 256
PROMPT_LEN = 1100  # 4 whole blocks and a 76-token tail
RID = "rel-a"


def main(work: Path) -> None:
    """In the release's interpreter: one engine, one batch, the pull, the metrics."""
    spec = json.loads((work / "spec.json").read_text())
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import pd_bridge_omlx

    llm = tiny_mla_hf.captured_llm(spec["hf_dir"], spec["mlx_dir"], spec["port"], TOKEN, max_model_len=2048, max_num_seqs=4, disable_log_stats=False,
                                   **spec.get("engine", {}))
    ids = tiny_mla_hf.prompt_ids(PROMPT_LEN, 11)
    stages = spec.get("stages", 1)  # vLLM's pipeline stages (test_vllm_pipeline.py)
    cap = {"kv_transfer_params": {"pd_capture": {"request_id": RID, "block_size": BLOCK, "secret": SECRET, **({"stages": stages} if stages > 1 else {})}}}
    prompts = [TokensPrompt(prompt_token_ids=ids), TokensPrompt(prompt_token_ids=tiny_mla_hf.prompt_ids(300, 12))]
    params = [SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=cap), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)]
    if stages > 1:  # and a decode host that does not know of the stages
        unstaged = {"kv_transfer_params": {"pd_capture": {"request_id": RID + "-unstaged", "block_size": BLOCK, "secret": SECRET}}}
        prompts.append(TokensPrompt(prompt_token_ids=tiny_mla_hf.prompt_ids(600, 14)))
        params.append(SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=unstaged))
    outs = llm.generate(prompts, params, use_tqdm=False)
    fp = pd_bridge_omlx.Weights.load(spec["mlx_dir"]).fingerprint
    writer = pd_bridge_omlx.BlockWriter(str(work / "blocks"), "tiny-mla", BLOCK, ids)
    try:
        n, verdict = pd_bridge_omlx.ingest("127.0.0.1", spec["port"], TOKEN.encode(), RID, fp, writer, timeout_seconds=60.0, secret=SECRET, token_ids=ids, stages=stages)
        ingested = {"blocks": n, "verdict": json.loads(verdict)}
    except Exception as e:  # recorded; the test decides
        ingested = {"error": f"{type(e).__name__}: {e}"}
    # One more (uncaptured) step carries the seal's stats to the frontend's loggers.
    time.sleep(1.0)
    llm.generate([TokensPrompt(prompt_token_ids=tiny_mla_hf.prompt_ids(16, 13))], SamplingParams(max_tokens=1), use_tqdm=False)
    metrics = [[m.name, dict(m.labels), m.value] for m in llm.get_metrics() if "pd_bridge" in m.name and getattr(m, "value", None) is not None]
    result = {"vllm": vllm.__version__, "ids": ids, "ingested": ingested, "metrics": metrics,
              "kv_transfer_params": outs[0].kv_transfer_params, "answers": [o.kv_transfer_params for o in outs], "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))

