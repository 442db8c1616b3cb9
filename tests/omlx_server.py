"""Drive a real oMLX server (the `omlx` package of flyto-mlx) from tests.

* `add_tokenizer(model_dir)` trains a small byte-level BPE (vocab 1024, the tiny models' vocab)
  on generated English-like text and saves it next to the weights, so oMLX and mlx-lm load the
  model offline. Same seed -> byte-identical tokenizer.json.
* `serve(model_root, cache_dir, home)` runs `omlx serve` on 127.0.0.1 with its own HOME and a
  paged SSD cache dir, waits until the model is loaded, and stops it on exit.
* `complete(base_url, model, prompt, max_tokens)` posts /v1/completions with urllib only.
* `block_hashes` / `read_block_header` recompute oMLX's block file names and parse its block
  files without MLX, as oracles for the bridge's own writer.

Only the standard library plus `tokenizers` (for training/encoding) is needed here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import engines
import ports  # tests/ports.py: this phase's own block of ports

VOCAB_SIZE = 1024

# DeepSeek's own marker strings, so oMLX's DeepSeek-V4 chat encoder (which writes them as
# text) maps each to one special id instead of a run of bytes.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]

# A DeepSeek-V3-style jinja template, enough for /v1/chat/completions on the MLA model.
# oMLX replaces it with its own Python encoder for deepseek_v4 (patches/deepseek_v4).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}"
    "<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)

_WORDS = (
    "the of and to in is was for on that with as by at from it this be are or an which "
    "have not had but were they his her one all their there been has more when will would "
    "who so no if out up what about into than them can only other new some could time these "
    "two may then do first any like my now over such our man me even most made after also "
    "did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might "
    "us great old year off come since against go came right used take three place house water "
    "river stone field market window garden letter morning evening winter summer village road "
    "train engine signal cache block layer token window prefix memory device server model "
    "quiet bright heavy simple careful early late small large green blue red golden silver "
    "walked carried opened closed wrote read built found kept held turned moved waited spoke "
    "slowly quickly gently clearly often always sometimes again together almost nearly"
).split()
_NAMES = "Alice Bruno Chen Dara Elif Farah Goran Hana Ivo Juno Kemal Lena Mira Noor Pia".split()


def english_text(n_words: int, seed: int = 0) -> str:
    """Deterministic English-like prose: sentences, names, numbers, paragraphs."""
    rng = random.Random(seed)
    out: list[str] = []
    words = 0
    while words < n_words:
        sentence = [rng.choice(_WORDS) for _ in range(rng.randint(5, 16))]
        if rng.random() < 0.3:
            sentence.insert(rng.randrange(len(sentence)), rng.choice(_NAMES))
        if rng.random() < 0.15:
            sentence.insert(rng.randrange(len(sentence)), str(rng.randint(2, 1999)))
        if rng.random() < 0.2:
            sentence[rng.randrange(len(sentence))] += ","
        sentence[0] = sentence[0][:1].upper() + sentence[0][1:]
        end = rng.choice(".....?!")
        out.append(" ".join(sentence) + end)
        words += len(sentence)
        if rng.random() < 0.12:
            out.append("\n\n")
    return " ".join(out).replace(" \n\n ", "\n\n").strip()


def train_tokenizer(seed: int = 0):
    """A byte-level BPE with exactly VOCAB_SIZE ids (specials first: BOS=0, EOS=1, PAD=2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    corpus = english_text(60_000, seed=seed)
    # Fixed-size pieces in a fixed order: training is deterministic for the same corpus.
    pieces = [corpus[i : i + 4096] for i in range(0, len(corpus), 4096)]
    tok.train_from_iterator(pieces, trainer=trainer, length=len(pieces))
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab {tok.get_vocab_size()} != {VOCAB_SIZE}")
    # Like DeepSeek's tokenizers: encode(text) prepends BOS (add_special_tokens=True).
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
            ),
        ]
    )
    return tok


def add_tokenizer(model_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and
    generation_config.json into `model_dir` (a copy of a tiny model). Returns the dir."""
    model_dir = Path(model_dir)
    tok = train_tokenizer(seed)
    tok.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    generation = {"bos_token_id": 0, "eos_token_id": 1}
    for name, obj in (
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", specials),
        ("generation_config.json", generation),
    ):
        (model_dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    return model_dir


def prepare_model(src: str | os.PathLike, model_root: str | os.PathLike, seed: int = 0) -> Path:
    """Copy a tiny model dir into `model_root/<name>` and give it the trained tokenizer.
    oMLX's --model-dir is a directory of model subdirectories; the subdir name is the model id."""
    src = Path(src)
    dst = Path(model_root) / src.name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return add_tokenizer(dst, seed)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(path: str, mtime_ns: int):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def encode(model_dir: str | os.PathLike, text: str) -> list[int]:
    """The ids oMLX uses for a /v1/completions text prompt: the scheduler calls
    `tokenizer.encode(prompt)` (add_special_tokens=True), i.e. BOS + BPE ids here."""
    path = Path(model_dir) / "tokenizer.json"
    return _load_tokenizer(str(path), path.stat().st_mtime_ns).encode(text).ids


def prompt_of_tokens(
    model_dir: str | os.PathLike, n_tokens: int, seed: int = 1
) -> tuple[str, list[int]]:
    """A text prompt that encodes (with BOS) to exactly `n_tokens` ids, and those ids.
    Cuts at a word boundary, then trims trailing characters to hit the count."""
    text = english_text(n_tokens, seed=seed)
    while len(encode(model_dir, text)) < n_tokens:
        text += " " + english_text(n_tokens, seed=seed + 1000)
    words = text.split(" ")
    lo, hi = 1, len(words)
    while lo < hi:  # fewest words whose encoding reaches n_tokens
        mid = (lo + hi) // 2
        if len(encode(model_dir, " ".join(words[:mid]))) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    text = " ".join(words[:lo])
    while len(encode(model_dir, text)) > n_tokens:
        text = text[:-1]
    ids = encode(model_dir, text)
    if len(ids) != n_tokens:
        raise RuntimeError(f"could not build a {n_tokens}-token prompt (got {len(ids)})")
    return text, ids


# --------------------------------------------------------------------------------------------
# oMLX's block key and block files (pure re-implementations, used as test oracles)
# --------------------------------------------------------------------------------------------


def block_hashes(model_name: str, token_ids: Sequence[int], block_size: int) -> list[str]:
    """omlx/cache/paged_cache.py compute_block_hash, chained over the full blocks only:
    sha256(model_name ‖ parent_digest|b"omlx-root" ‖ str(tuple(ids))). `model_name` is the
    absolute model directory path oMLX loaded (the block's `model_name` metadata)."""
    out: list[str] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256()
        if model_name:
            h.update(model_name.encode("utf-8"))
        h.update(parent if parent else b"omlx-root")
        h.update(str(tuple(int(t) for t in token_ids[start : start + block_size])).encode("utf-8"))
        parent = h.digest()
        out.append(parent.hex())
    return out


def block_path(cache_dir: str | os.PathLike, block_hash_hex: str) -> Path:
    return Path(cache_dir) / block_hash_hex[0] / f"{block_hash_hex}.safetensors"


def block_files(cache_dir: str | os.PathLike) -> list[Path]:
    """Finished block files (oMLX's temp files end in `_tmp.safetensors`)."""
    root = Path(cache_dir)
    return sorted(
        p
        for d in "0123456789abcdef"
        for p in (root / d).glob("*.safetensors")
        if not p.name.endswith("_tmp.safetensors")
    )


def read_block_header(path: str | os.PathLike) -> dict:
    """Parse a safetensors header without MLX: {'header_len', 'tensors': [(name, dtype, shape,
    [begin, end])...] in file order, 'metadata': {...}, 'key_order': [...]}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    header = json.loads(raw)  # dicts keep the file's key order
    tensors = [
        (k, v["dtype"], v["shape"], v["data_offsets"])
        for k, v in header.items()
        if k != "__metadata__"
    ]
    return {
        "header_len": n,
        "key_order": list(header),
        "tensors": tensors,
        "metadata": header.get("__metadata__", {}),
    }


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


def installed_omlx():
    """The installed oMLX's entry in pd-bridge's versions table (fork or upstream)."""
    from pd_bridge_omlx import versions

    return versions.detect()


@dataclass
class OmlxServer:
    base_url: str
    port: int
    model: str  # the API model id (the model's subdirectory name)
    model_path: Path  # oMLX's model_name (hashed into every block key): resolved root / id
    cache_dir: Path
    home: Path
    log_path: Path  # the subprocess's stdout+stderr
    process: subprocess.Popen
    startup_s: float  # spawn -> model loaded

    @property
    def cache_model_name(self) -> str:
        """What this oMLX hashes into block keys and stamps as `model_name`: the fork the model
        directory's path, upstream the model id (versions table)."""
        return str(self.model_path) if installed_omlx().model_name == "path" else self.model

    @property
    def server_log(self) -> Path:
        """oMLX's own log file (has request ids), under $HOME/.fmlx/logs (the fork) or
        $HOME/.omlx/logs (upstream)."""
        for base in (".omlx", ".fmlx"):
            if (self.home / base / "logs" / "server.log").exists():
                return self.home / base / "logs" / "server.log"
        return self.home / ".omlx" / "logs" / "server.log"


def free_port() -> int:
    return ports.free_port()


def _omlx_command() -> list[str]:
    # The console script next to this interpreter, else the module entry point.
    script = Path(sys.executable).parent / "omlx"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "omlx.cli"]


def _request(url: str, body: dict | None = None, timeout: float = 600.0, headers: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:2000]
        raise RuntimeError(f"{url}: HTTP {e.code}: {detail}") from None


def _stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    # SIGINT is uvicorn's graceful shutdown (it also runs oMLX's cache close/flush).
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace)
        return
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        # The server runs in its own session (pgid == its pid): kill that group only.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def serve(
    model_root: str | os.PathLike,
    cache_dir: str | os.PathLike,
    home: str | os.PathLike,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
    model: str | None = None,
    log_level: str = "info",
    timeout: float = 900.0,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
) -> Iterator[OmlxServer]:
    """Run `omlx serve --model-dir MODEL_ROOT --paged-ssd-cache-dir CACHE_DIR` on 127.0.0.1.

    `model_root` holds model subdirectories (each with config.json); `model` picks the one to
    load up front (default: the only/first one). `home` becomes $HOME, so settings, logs and
    the admin state live in `home/.fmlx` (`home/.omlx` upstream) and nothing leaks into the real home. The hot cache
    stays off, so every stored block goes straight to the writer thread and onto disk.
    `api_key`: start oMLX with `--api-key` and its verification on (the model load sends it).
    """
    model_root = Path(model_root).resolve()
    cache_dir = Path(cache_dir).resolve()
    home = Path(home).resolve()
    cache_dir.mkdir(parents=True, exist_ok=True)
    if model is None:
        names = sorted(p.name for p in model_root.iterdir() if (p / "config.json").exists())
        if not names:
            raise FileNotFoundError(f"no model subdirectory with config.json in {model_root}")
        model = names[0]
    # Open API and admin routes (the admin load route needs auth otherwise); no network use.
    # The fork (flyto-mlx) keeps its settings in ~/.fmlx, upstream oMLX in ~/.omlx.
    for base in (home / ".fmlx", home / ".omlx"):
        base.mkdir(parents=True, exist_ok=True)
        settings_file = base / "settings.json"
        if api_key is not None or not settings_file.exists():
            settings_file.write_text(
                json.dumps({"version": "1.0", "auth": {"skip_api_key_verification": api_key is None}}, indent=2)
            )
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMLX_", "FMLX_"))}
    env.update(
        HOME=str(home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra_env or {})
    cmd = [
        *_omlx_command(), "serve",
        "--model-dir", str(model_root),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--paged-ssd-cache-dir", str(cache_dir),
        "--log-level", log_level,
        *(("--api-key", api_key) if api_key is not None else ()),
        *extra_args,
    ]  # fmt: skip
    log_path = home / f"omlx-serve-{port}.log"
    t0 = time.monotonic()
    engines.starting("omlx serve")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=str(home), start_new_session=True)  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = t0 + timeout

        def check_alive() -> None:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-4000:]
                raise RuntimeError(f"omlx serve exited with {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"omlx serve not ready after {timeout:.0f}s; see {log_path}")

        while True:
            check_alive()
            try:
                _request(f"{base_url}/health", timeout=5)
                break
            except (OSError, RuntimeError):
                time.sleep(0.5)
        # Load the model now, so the first request's timing is prefill only.
        remaining = max(1.0, deadline - time.monotonic())
        auth = {"Authorization": f"Bearer {api_key}"} if api_key is not None else None
        _request(f"{base_url}/admin/api/models/{model}/load", {}, timeout=remaining, headers=auth)
        yield OmlxServer(
            base_url=base_url, port=port, model=model,
            model_path=model_root / model, cache_dir=cache_dir, home=home,
            log_path=log_path, process=proc, startup_s=time.monotonic() - t0,
        )  # fmt: skip
    finally:
        _stop(proc)


def complete(
    base_url: str,
    model: str,
    prompt: str | Sequence[int],
    max_tokens: int = 4,
    timeout: float = 1800.0,
    **params,
) -> dict:
    """POST /v1/completions (greedy by default) and return the parsed JSON. `usage` carries
    prompt_tokens and prompt_tokens_details.cached_tokens.

    oMLX 0.7.0's CompletionRequest takes `prompt: str | list[str]` only: a list of token ids is
    rejected with HTTP 422, so ids are refused here rather than sent."""
    if not isinstance(prompt, str):
        raise TypeError("oMLX /v1/completions accepts text prompts only (token ids give HTTP 422)")
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body.update(params)
    return _request(f"{base_url}/v1/completions", body, timeout=timeout)


def logged_block_size(server: OmlxServer) -> int | None:
    """The block size the scheduler chose for the loaded model (512 for DeepSeek-V4's
    128-row window, 256 for plain-KVCache models), from its startup log line."""
    found = re.findall(r"paged SSD cache enabled: .*block_size=(\d+) tokens", _log_text(server))
    return int(found[-1]) if found else None


def logged_prefill_chunks(server: OmlxServer) -> list[tuple[str, int, int]]:
    """(request id, chunk tokens, tokens processed so far) per prefill forward, from the
    scheduler's `[memcheck:external]` lines (logged while the memory guard is active)."""
    pattern = r"\[memcheck:external\] rid=(\S+) n=(\d+) processed=(\d+)"
    return [(rid, int(n), int(done)) for rid, n, done in re.findall(pattern, _log_text(server))]


def _log_text(server: OmlxServer) -> str:
    return server.log_path.read_text(errors="replace")


def wait_for_blocks(cache_dir: str | os.PathLike, count: int, timeout: float = 60.0) -> list[Path]:
    """Blocks are written by oMLX's background writer thread after the response; poll."""
    deadline = time.monotonic() + timeout
    while True:
        files = block_files(cache_dir)
        if len(files) >= count or time.monotonic() > deadline:
            return files
        time.sleep(0.2)
