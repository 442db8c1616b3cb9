"""The decode side's modules import one way: ``hooks`` (oMLX's objects) → ``bridge`` (the
orchestration) → ``store`` (oMLX's cache index), no two modules of ``pd_bridge_omlx`` importing
each other, function-level imports included. Static (``ast``): nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "pd_bridge_omlx"
SOURCE = Path(__file__).resolve().parents[2] / "omlx_patch" / "python" / PACKAGE


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports anywhere in it (module level, inside functions and
    classes, ``importlib.import_module`` with a literal name); ``__init__`` for a name taken from
    the package itself."""
    out: set[str] = set()

    def named(dotted: str) -> None:
        parts = dotted.split(".")
        if parts[0] == PACKAGE:
            out.add(parts[1] if len(parts) > 1 and parts[1] in modules else "__init__")

    def from_package(names: list[ast.alias]) -> None:
        for a in names:
            out.add(a.name if a.name in modules else "__init__")

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                named(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module == PACKAGE:
                    from_package(node.names)
                elif node.module:
                    named(node.module)
            elif node.level == 1:  # a flat package: `.` is pd_bridge_omlx
                if node.module is None:
                    from_package(node.names)
                else:
                    head = node.module.split(".")[0]
                    out.add(head if head in modules else "__init__")
            else:
                raise AssertionError(f"{path.name}: import from above the package (level {node.level})")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if arg.value.startswith("."):
                    head = arg.value.lstrip(".").split(".")[0]
                    out.add(head if head in modules else "__init__")
                else:
                    named(arg.value)
    out.discard(path.stem)
    return out


def graph(source: Path) -> dict[str, set[str]]:
    files = {p.stem: p for p in source.glob("*.py")}
    # The native module (Rust) is a node too, though it imports nothing of the package.
    modules = set(files) | {p.stem for p in source.glob("*.pyi")}
    return {name: imports_of(path, modules) for name, path in sorted(files.items())}


def mutual_pairs(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in g.items() for b in deps if a < b and a in g.get(b, ()))


def a_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_two_modules_import_each_other():
    g = graph(SOURCE)
    assert {"hooks", "bridge", "store"} <= set(g), sorted(g)
    assert mutual_pairs(g) == [], f"modules importing each other: {mutual_pairs(g)}; graph: {g}"
    assert a_cycle(g) is None, f"import cycle: {' -> '.join(a_cycle(g))}"


def test_the_chain_runs_hooks_then_bridge_then_store():
    g = graph(SOURCE)
    assert "bridge" in g["hooks"] and "store" in g["bridge"], g
    assert not g["store"] & {"hooks", "bridge", "middleware", "cli", "_autoload"}, g["store"]
    assert "hooks" not in g["bridge"], g["bridge"]
    # Only the import hook installs the hooks.
    assert [m for m, deps in g.items() if "hooks" in deps] == ["_autoload"], g


def test_the_check_sees_function_level_imports(tmp_path):
    """The checker itself: imports inside functions, of either spelling, count."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("def f():\n    from .b import x\n    return x\n")
    (tmp_path / "b.py").write_text("def g():\n    from pd_bridge_omlx import a\n    return a\n")
    (tmp_path / "c.py").write_text("import importlib\nclass C:\n    def m(self):\n        return importlib.import_module('pd_bridge_omlx.a')\n")
    g = graph(tmp_path)
    assert g["a"] == {"b"} and g["b"] == {"a"} and g["c"] == {"a"}
    assert mutual_pairs(g) == [("a", "b")]
    assert a_cycle(g) in (["a", "b", "a"], ["b", "a", "b"])
