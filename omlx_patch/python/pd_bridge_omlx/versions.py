"""Which oMLX this is, and what that means for the bridge: the one table.

Each supported oMLX is one ``OmlxVersion`` entry: the distribution that ships it (told apart by
``importlib.metadata``, never by the version string: the PyPI fork ``flyto-mlx`` 0.7.0 carries
upstream oMLX 0.3.9.dev1 under the version "0.7.0"), the block-format descriptor the Rust core
writes and validates for it (``core/src/format.rs``, passed by name), and the hook points the
hooks wrap (``hooks.py``). Supporting another oMLX release is one more entry here and, when its block
format changed, one more ``OmlxFormat`` variant in the core.

Protocol details (format version, metadata keys, cache signature, payload layout, DeepSeek-V4
block size, pool layout, ratio-4 overlap semantics) live in the core only; this table names the
descriptor and says where to hook.

Known ahead, from upstream's public history (not obtainable here, so not an entry yet):
oMLX 0.7.0 (commit ``4d4f5a28``, 2026-09-30) adds ``parent_hash`` and ``tail_terminal``
metadata, short tail blocks salted ``"omlx-tail-v1"``, a 5-tuple ``PoolingCache`` signature
entry and ``omlx/patches/deepseek_v41`` (DeepSeek-V4.1: pools shared across layers, no APE, no
overlap). Adding it: a core ``OmlxFormat::Upstream070`` (its chain hash takes the tail salt,
its metadata the two new keys; pools and overlap as ``Upstream063``) and an entry below with
``distribution="omlx"`` and ``versions=("0.7.0",)``; the hook points are expected to stay
those of 0.6.3 (check ``Scheduler._prepare_prefix_cache_for_request`` is still the lookup).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class OmlxVersion:
    """One supported oMLX: how to recognise it, its block format, where the hooks wrap."""

    key: str
    distribution: str  # the importlib.metadata distribution that provides the `omlx` package
    versions: tuple[str, ...]  # the distribution versions accepted
    omlx_format: str  # the core's OmlxFormat name (pd_bridge_omlx.omlx_formats())
    # Hook points: (module, class, attribute) the hooks wrap.
    block_reader: tuple[str, str, str]  # reads one block file's metadata for the index
    request_entry: tuple[str, str, str]  # where a request enters the engine (the bridge runs first)
    prefix_lookup: tuple[str, str, str]  # where the scheduler looks the prompt up in the prefix cache
    # Where the engine hands a request its outputs: the first one with a token ends its prefill
    # (times native prefills for the rate-based decision, rates.py).
    first_output: tuple[str, str, str]
    # When that lookup has run: "request_entry" (inside it: done when it returns) or "admission"
    # (later, when the scheduler admits the request: the verdict is confirmed from that hook).
    lookup_at: str
    server: str  # module whose FastAPI `app` gets the bridge's routes
    settings_dir: str  # under $HOME
    # What oMLX hashes into every block key and stamps as `model_name`: "path" (the model
    # directory it loaded) or "id" (the model id, the subdirectory name).
    model_name: str

    def model_name_for(self, entry) -> str:
        """The model string for a loaded engine-pool entry (``entry.model_path``, ``entry.model_id``)."""
        if self.model_name == "path":
            return str(entry.model_path)
        return str(getattr(entry, "model_id", None) or getattr(entry, "model_path").name)

    def describe(self) -> str:
        return f"{self.distribution} {'/'.join(self.versions)} (block format {self.omlx_format})"


SUPPORTED: tuple[OmlxVersion, ...] = (
    OmlxVersion(
        key="upstream-0.6.3",
        distribution="omlx",
        versions=("0.6.3rc2", "0.6.3"),
        omlx_format="upstream-0.6.3",
        block_reader=("omlx.cache.paged_ssd_cache", "PagedSSDCacheManager", "_read_file_metadata"),
        request_entry=("omlx.engine_core", "EngineCore", "add_request"),
        prefix_lookup=("omlx.scheduler", "Scheduler", "_prepare_prefix_cache_for_request"),
        first_output=("omlx.output_collector", "RequestOutputCollector", "put"),
        lookup_at="admission",
        server="omlx.server",
        settings_dir=".omlx",
        model_name="id",
    ),
    OmlxVersion(
        key="fork-0.7.0",
        distribution="flyto-mlx",
        versions=("0.7.0",),
        omlx_format="fork-0.7.0",
        block_reader=("omlx.cache.paged_ssd_cache", "PagedSSDCacheManager", "_read_file_metadata"),
        request_entry=("omlx.engine_core", "EngineCore", "add_request"),
        prefix_lookup=("omlx.scheduler", "Scheduler", "add_request"),
        first_output=("omlx.output_collector", "RequestOutputCollector", "put"),
        lookup_at="request_entry",
        server="omlx.server",
        settings_dir=".fmlx",
        model_name="path",
    ),
)


class UnsupportedOmlxError(RuntimeError):
    pass


def supported_text() -> str:
    return "; ".join(v.describe() for v in SUPPORTED)


def installed_distributions() -> dict[str, str]:
    """The distributions providing the top-level `omlx` package, with their versions."""
    found: dict[str, str] = {}
    try:
        providers = metadata.packages_distributions().get("omlx", [])
    except Exception:  # pragma: no cover - broken metadata
        providers = []
    for name in set(providers) | {v.distribution for v in SUPPORTED}:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if name not in providers and not _provides_omlx(name):
            del found[name]
    return found


def _provides_omlx(dist: str) -> bool:
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        return False
    return any(str(f).startswith("omlx/") for f in files)


def match(distributions: dict[str, str]) -> OmlxVersion:
    """The table entry for these installed distributions, or ``UnsupportedOmlxError`` naming
    what was found and what is supported."""
    if not distributions:
        raise UnsupportedOmlxError(f"no installed distribution provides the `omlx` package; pd-bridge-omlx supports {supported_text()}")
    if len(distributions) > 1:
        both = ", ".join(f"{d} {v}" for d, v in sorted(distributions.items()))
        raise UnsupportedOmlxError(f"more than one distribution provides `omlx` ({both}); install exactly one of: {supported_text()}")
    (dist, version), = distributions.items()
    for v in SUPPORTED:
        if v.distribution == dist and version in v.versions:
            return v
    raise UnsupportedOmlxError(
        f"pd-bridge-omlx supports {supported_text()}; this is {dist} {version}. "
        "Unset PD_BRIDGE_OMLX to run oMLX without the bridge, or install a supported oMLX."
    )


_detected: OmlxVersion | None = None


def detect() -> OmlxVersion:
    """The installed oMLX's entry (cached); raises ``UnsupportedOmlxError`` otherwise."""
    global _detected
    if _detected is None:
        _detected = match(installed_distributions())
    return _detected


def by_key(key: str) -> OmlxVersion:
    for v in SUPPORTED:
        if v.key == key:
            return v
    raise KeyError(f"no oMLX version {key!r}; known: {', '.join(v.key for v in SUPPORTED)}")
