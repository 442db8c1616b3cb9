#!/usr/bin/env python3
"""The decode side of the GPU-host run (tests/gpu/vllm_capture.py), here, in the decode venv.

    python3 tests/gpu/decode_check.py prompts PROMPTS.json   # before: the prompts for the H200
    python3 tests/gpu/decode_check.py check OUT              # after: OUT is vllm_capture.py's output

``prompts``: two English prompts (4,400 and 2,600 tokens) and their ids under the tokenizer the
tests train (tests/omlx_server.py), so that the ids vLLM prefills on the GPU host are exactly
what oMLX tokenizes here from the text.

``check``: for MLA, the GPU host's checkpoint becomes an oMLX model dir (``tiny-mla-gpu``), the
upstream-format blocks the decode host's client wrote there (request a) go into a cache dir, and a
real upstream oMLX (plain, no bridge) serves the prompt's text: its ``cached_tokens`` must be
every bridged block, every block must pass the core's validator, and the decoder's predictions
from those blocks must be within the fidelity bound of tests/fidelity.py (with its broken-cache
controls outside it). For DeepSeek-V4 every block is validated against the decoder's plan (oMLX
cannot serve the FP8 checkpoint here, and the fidelity measure is MLA-only). Prints JSON; exit 0
when every check passes.
"""

from __future__ import annotations

import json
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import omlx_server  # noqa: E402

sys.path.insert(0, str(HERE))
from vllm_capture import FORMATS, MODEL_NAME, PROMPTS  # noqa: E402  (stdlib-only at import)

FORMAT_A = FORMATS["a"]


def prompts(path: Path) -> int:
    tok = omlx_server.add_tokenizer(Path(tempfile.mkdtemp(prefix="pdb-tok-")))
    out = {}
    for k, (n, seed) in PROMPTS.items():
        text, ids = omlx_server.prompt_of_tokens(tok, n, seed=seed)
        out[k] = {"text": text, "ids": ids}
    path.write_text(json.dumps(out))
    print(f"{path}: " + ", ".join(f"{k} {len(v['ids'])} tokens" for k, v in out.items()))
    return 0


def untar(tar: Path, dest: Path) -> Path:
    with tarfile.open(tar) as tf:
        tf.extractall(dest, filter="data")
    return dest


def unpack(family: str, out: Path, work: Path, blocks_dir: str, prompt: dict) -> tuple[dict, dict, Path, list[int], int, int, int]:
    """Untar the family's model and request a's blocks; validate every block with the core's
    validator. Returns (result, its checks, blocks dir, ids, block size, blocks, tokens)."""
    import pd_bridge_omlx

    res: dict = {"family": family, "checks": {}}
    ok = res["checks"]
    untar(out / f"{family}-model.tar", work)
    blocks = untar(out / f"{family}-a-blocks.tar", work / blocks_dir)
    ids = json.loads((work / f"{family}-a.ids.json").read_text())
    ok["the GPU host prefilled exactly the prompt's ids"] = ids == prompt["ids"]
    w = pd_bridge_omlx.Weights.load(str(work / f"{family}-mlx"))
    block = pd_bridge_omlx.expected_block_size(w, FORMAT_A)
    files = sorted(blocks.rglob("*.safetensors"))
    tokens = sum(pd_bridge_omlx.inspect_block(str(f), MODEL_NAME[family], w.num_layers, block, FORMAT_A)[1] for f in files)
    res["blocks"], res["block_size"] = len(files), block
    return res, ok, blocks, ids, block, len(files), tokens


def check_mla(out: Path, work: Path, prompt: dict) -> dict:
    import e2e_stack
    import fidelity as F

    res, ok, blocks, ids, block, n_blocks, tokens = unpack("mla", out, work, "cache", prompt)
    model_dir = e2e_stack.omlx_model_from_hf(work / "mla-hf", work / "models" / MODEL_NAME["mla"])
    ok[f"every block valid for the decoder's plan ({n_blocks} blocks, {tokens} tokens)"] = n_blocks > 0 and tokens == n_blocks * block
    with omlx_server.serve(work / "models", blocks, work / "home", model=MODEL_NAME["mla"]) as server:
        resp = omlx_server.complete(server.base_url, server.model, prompt["text"], max_tokens=1)
        cached = e2e_stack.cached_tokens(resp)
        res["cached_tokens"] = cached
        ok[f"upstream oMLX served the bridged blocks: cached_tokens == {n_blocks * block}"] = cached == n_blocks * block
        report = e2e_stack.fidelity(e2e_stack.Model(work / "mla-hf", work / "models", model_dir, work / "mla-mlx", ""), server, ids, cached, block, with_controls=True)
    res["fidelity"] = report.lines()
    ok[f"the decoder's predictions within the bound ({F.BOUND})"] = report.bridged.within()
    # The block-level bound of the end-to-end tests: the engines' arithmetic differs by ~1%.
    res["cache_rel_rms"] = report.cache_rel_rms
    ok["the bridged cache within 3% relative RMS of the decoder's own"] = report.cache_rel_rms <= 0.03
    # On this model (4 heads of 128 + 64, near-uniform attention over 4,352 positions) a latent one
    # row off its rotary key moves the predictions too little for the distribution bound to see
    # (measured mean KL 3.2e-6); its cache is ~140% RMS off, which the check above refuses.
    ok["the broken-cache controls outside the bound (latent-one-row-off: see the cache check), 3% noise within"] = all(
        f.within() == name.startswith("noise") for name, f in report.controls.items() if name != "latent one row off"
    )
    return res


def check_v4(out: Path, work: Path, prompt: dict) -> dict:
    res, ok, _, ids, block, n_blocks, tokens = unpack("v4", out, work, "blocks", prompt)
    want = len(ids) // block
    ok[f"every block valid for the decoder's plan ({n_blocks} of {want} blocks, {tokens} tokens)"] = n_blocks == want > 0 and tokens == want * block
    return res


def check(out: Path, prompts_file: Path | None) -> int:
    prompt_sets = json.loads((prompts_file or out / "prompts.json").read_text())
    results = []
    for family, fn in (("mla", check_mla), ("v4", check_v4)):
        if not (out / f"{family}-model.tar").exists():
            results.append({"family": family, "error": f"{out}/{family}-model.tar is missing"})
            continue
        work = Path(tempfile.mkdtemp(prefix=f"pdb-decode-{family}-"))
        try:
            results.append(fn(out, work, prompt_sets["a"]))
        except Exception as e:  # report, go on with the next family
            results.append({"family": family, "error": f"{type(e).__name__}: {e}"})
    for r in results:
        r["passed"] = "error" not in r and all(r["checks"].values())
    print(json.dumps(results, indent=1))
    return 0 if all(r["passed"] for r in results) else 1


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "prompts":
        return prompts(Path(sys.argv[2]))
    if len(sys.argv) >= 3 and sys.argv[1] == "check":
        return check(Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
