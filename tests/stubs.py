"""A wheel's shipped ``_native.pyi`` against the built module (used by both wheels' tests)."""

from __future__ import annotations

import ast
from pathlib import Path


def public(obj) -> set[str]:
    return {n for n in vars(obj) if not n.startswith("_")}


def stub_names(stub: Path) -> dict[str, set[str] | None]:
    """{top-level name: member names (classes) or None} declared by a .pyi stub."""
    out: dict[str, set[str] | None] = {}
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
    return out


def assert_stub_matches(module) -> None:
    """The stub installed beside ``module`` declares exactly what it exports, members included."""
    stub = Path(module.__file__).with_name("_native.pyi")
    assert stub.is_file(), f"{stub} is not installed with the wheel"
    declared = stub_names(stub)
    assert set(declared) == public(module), set(declared) ^ public(module)
    for name, members in declared.items():
        obj = getattr(module, name)
        if members is not None and not issubclass(obj, BaseException):
            assert members == public(obj), (name, members ^ public(obj))
