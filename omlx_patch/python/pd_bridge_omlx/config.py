"""The decode-side bridge's settings, read once from the environment.

Every setting has one env var; a bad value is a clear error naming the variable, and the bridge
then stays off (oMLX serves natively, each response says why) instead of guessing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit


class BridgeConfigError(ValueError):
    """A pd-bridge setting is missing or malformed; the message names the variable."""


@dataclass(frozen=True)
class PrefillTarget:
    """One prefill host: vLLM's OpenAI server and its segment server."""

    #: vLLM's OpenAI server, e.g. ``http://gpu-box:8000``.
    url: str
    #: Where its segment server listens (``PdBridgeConnector``'s port).
    segments_host: str
    segments_port: int
    #: vLLM data parallelism behind one endpoint: the rank this target pins requests to (the
    #: ``X-data-parallel-rank`` header) and pulls from (its segment port is the base + rank).
    dp_rank: int | None = None
    #: vLLM pipeline parallelism on the host: its stages each serve their layers' part of every
    #: block, stage ``s`` on ``segments_port + s`` (``PD_BRIDGE_PREFILL_PP``); the parts are joined.
    stages: int = 1
    #: How verdicts and logs name it: "prefill host", "prefill host 2 of 3", "... rank 1".
    label: str = "prefill host"


@dataclass(frozen=True)
class BridgeConfig:
    #: The prefill hosts (each data-parallel rank of each, ``PD_BRIDGE_PREFILL_DP``), in the order
    #: given: a bridge goes to the one with the fewest of this decode host's bridges in flight
    #: (the first on a tie) and fails over to the next while no block has arrived.
    prefill_hosts: tuple[PrefillTarget, ...]
    #: The shared secret both hosts hold (``PD_BRIDGE_VLLM_TOKEN`` on the prefill host).
    token: bytes
    #: The model name vLLM serves; None: the first one ``/v1/models`` lists.
    prefill_model: str | None
    min_prompt_tokens: int
    min_uncached_tokens: int
    #: Longest a bridge may take before oMLX gives up on it and prefills natively.
    timeout_s: float
    #: Longest the segment stream may stay silent.
    idle_s: float
    #: The decoder weights whose fingerprint must match the prefill host's; None: the model
    #: directory oMLX loaded.
    weights_dir: str | None
    #: Longest the HTTP client waits to connect to the prefill host (each request).
    connect_timeout_s: float = 5.0
    #: Bridges in flight at once (their HTTP request and stream each hold an I/O thread until
    #: they end, however stalled the prefill host is); a prompt past the cap is declined and
    #: served natively at once.
    max_bridges: int = 4
    #: vLLM's ``--api-key``, sent as ``Authorization: Bearer`` (vLLM guards its ``/v1`` routes).
    prefill_api_key: str | None = None
    #: Streams one capture is pulled over at once (each sealed and opened on its own core at
    #: both ends): one stream carries about what one core encrypts (~1.6 GB/s), so a link faster
    #: than 10 GbE wants more.
    wire_lanes: int = 1
    #: How a prompt past the floors is decided: "rates" (bridge only where predicted faster than
    #: a native prefill, from measured rates: rates.py) or "thresholds" (always bridge).
    decide: str = "rates"
    #: A prefill host's estimate older than this is re-measured by bridging.
    rate_max_age_s: float = 600.0

    # The first prefill host's (the only one's, in the common case).
    @property
    def prefill_url(self) -> str:
        return self.prefill_hosts[0].url

    @property
    def segments_host(self) -> str:
        return self.prefill_hosts[0].segments_host

    @property
    def segments_port(self) -> int:
        return self.prefill_hosts[0].segments_port


def _int(env, name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BridgeConfigError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise BridgeConfigError(f"{name}={value} must be at least {minimum}")
    return value


def _float(env, name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BridgeConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):  # also refuses NaN
        raise BridgeConfigError(f"{name}={raw!r} must be a positive, finite number of seconds")
    return value


def from_env(env=None) -> BridgeConfig | None:
    """The bridge's settings, or None when no prefill host is configured (bridge off).

    Raises ``BridgeConfigError`` naming the variable when one is set but unusable."""
    env = os.environ if env is None else env
    raw_urls = env.get("PD_BRIDGE_PREFILL_URL", "").strip()
    if not raw_urls:
        return None
    urls = [u.strip().rstrip("/") for u in raw_urls.replace(" ", ",").split(",") if u.strip()]
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BridgeConfigError(f"PD_BRIDGE_PREFILL_URL: {url!r} must be http(s)://host:port of vLLM's OpenAI server")
    if len(set(urls)) != len(urls):
        raise BridgeConfigError(f"PD_BRIDGE_PREFILL_URL={raw_urls!r} lists a host twice")
    token = env.get("PD_BRIDGE_TOKEN", "")
    token_file = env.get("PD_BRIDGE_TOKEN_FILE", "").strip()
    if token_file:
        try:
            token = open(token_file, encoding="utf-8").read().strip()
        except OSError as e:
            raise BridgeConfigError(f"PD_BRIDGE_TOKEN_FILE={token_file!r} cannot be read: {e}") from None
    if not token:
        raise BridgeConfigError("PD_BRIDGE_TOKEN (or PD_BRIDGE_TOKEN_FILE) must hold the secret shared with the prefill host")
    raw_segs = env.get("PD_BRIDGE_SEGMENTS", "").strip()
    segs = [s.strip() for s in raw_segs.replace(" ", ",").split(",") if s.strip()]
    if segs and len(segs) != len(urls):
        raise BridgeConfigError(f"PD_BRIDGE_SEGMENTS lists {len(segs)} segment servers for {len(urls)} prefill hosts in PD_BRIDGE_PREFILL_URL: give one host:port per host, in the same order (or none: each host's own name, port 7188)")  # fmt: skip
    dp = _int(env, "PD_BRIDGE_PREFILL_DP", 1, minimum=1)
    pp = _int(env, "PD_BRIDGE_PREFILL_PP", 1, minimum=1)
    if pp > 16:
        raise BridgeConfigError(f"PD_BRIDGE_PREFILL_PP={pp}: a capture is pulled from at most 16 pipeline stages")
    targets = []
    for i, url in enumerate(urls):
        if segs:
            host, sep, port = segs[i].rpartition(":")
            if not sep or not host:
                raise BridgeConfigError(f"PD_BRIDGE_SEGMENTS: {segs[i]!r} must be host:port of the prefill host's segment server")
            try:
                seg_port = int(port)
            except ValueError:
                raise BridgeConfigError(f"PD_BRIDGE_SEGMENTS: {segs[i]!r}: port {port!r} is not a number") from None
        else:
            host, seg_port = urlsplit(url).hostname, 7188
        if not 0 < seg_port or seg_port + dp * pp - 1 >= 65536:
            raise BridgeConfigError(f"PD_BRIDGE_SEGMENTS port {seg_port} is out of range" + (f" for {dp} data-parallel ranks x {pp} pipeline stages (PD_BRIDGE_PREFILL_DP, PD_BRIDGE_PREFILL_PP)" if dp * pp > 1 else ""))
        name = "prefill host" if len(urls) == 1 else f"prefill host {i + 1} of {len(urls)}"
        for r in range(dp):
            # Rank r's stages listen on base + r x stages + stage (the prefill host's rule).
            targets.append(PrefillTarget(url=url, segments_host=host.strip("[]"), segments_port=seg_port + r * pp,
                                         dp_rank=r if dp > 1 else None, stages=pp, label=f"{name} rank {r}" if dp > 1 else name))  # fmt: skip
    return BridgeConfig(
        prefill_hosts=tuple(targets),
        token=token.encode(),
        prefill_model=env.get("PD_BRIDGE_PREFILL_MODEL", "").strip() or None,
        min_prompt_tokens=_int(env, "PD_BRIDGE_MIN_PROMPT_TOKENS", 2048),
        min_uncached_tokens=_int(env, "PD_BRIDGE_MIN_UNCACHED_TOKENS", 1024, minimum=1),
        timeout_s=_float(env, "PD_BRIDGE_TIMEOUT_S", 600.0),
        idle_s=_float(env, "PD_BRIDGE_IDLE_S", 60.0),
        weights_dir=env.get("PD_BRIDGE_WEIGHTS", "").strip() or None,
        connect_timeout_s=_float(env, "PD_BRIDGE_CONNECT_TIMEOUT_S", 5.0),
        max_bridges=_int(env, "PD_BRIDGE_MAX_BRIDGES", 4, minimum=1),
        prefill_api_key=env.get("PD_BRIDGE_PREFILL_API_KEY", "").strip() or None,
        wire_lanes=_wire_lanes(env),
        decide=_decide(env),
        rate_max_age_s=_float(env, "PD_BRIDGE_RATE_MAX_AGE_S", 600.0),
    )


def _decide(env) -> str:
    how = env.get("PD_BRIDGE_DECIDE", "").strip().lower() or "rates"
    if how not in ("rates", "thresholds"):
        raise BridgeConfigError(f"PD_BRIDGE_DECIDE={how!r} must be 'rates' or 'thresholds'")
    return how


def _wire_lanes(env) -> int:
    lanes = _int(env, "PD_BRIDGE_WIRE_LANES", 1, minimum=1)
    if lanes > 16:
        raise BridgeConfigError(f"PD_BRIDGE_WIRE_LANES={lanes} must be at most 16")
    return lanes
