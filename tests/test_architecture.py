"""The package's shape: no import cycle (lazy imports and package __init__ files count), modules of bounded size,
a thin Session, and every name imported from the module that defines it (only a package's ``__init__`` re-exports)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mmkv"
REPO = PACKAGE.parent
# The project's importable trees: a name any of them imports from one of them must come from its defining module.
TREES = ("mmkv", "evals", "app", "bench", "training", "tests", "examples")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the mmkv modules its import statements load, anywhere in the file (function bodies too); an
    import of ``a.b.c`` loads the packages ``a`` and ``a.b`` as well (their ``__init__`` runs)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                found = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in found:
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    prefix = ".".join(parts[:i])
                    if prefix in modules:
                        targets.add(prefix)
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = targets - own_packages - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_inside_mmkv():
    """No chain of imports (module-level or lazy, package __init__ files included) leads back to its start."""
    graph = _import_graph()
    assert "mmkv.session" in graph and "mmkv.runtime.plan" in graph["mmkv.session"] | graph["mmkv.runtime"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    """The checker itself: a planted two-module cycle is reported."""
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_modules_stay_small_and_session_thin():
    """No module in mmkv/ over 400 lines; mmkv/session.py at most 300."""
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert sizes["session.py"] <= 300, sizes["session.py"]
    too_long = {name: n for name, n in sizes.items() if n > 400}
    assert not too_long, too_long


def _defined_names(tree: ast.Module) -> set[str]:
    """The names a module binds itself at top level (functions, classes, assignments, also under if/try); the
    names it only imports are not among them."""
    names: set[str] = set()
    for node in tree.body:
        for inner in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else (node,):
            if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(inner.name)
            elif isinstance(inner, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = inner.targets if isinstance(inner, ast.Assign) else [inner.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _re_exports(sources: dict[str, tuple[bool, str]]) -> list[str]:
    """Every import of a name from a module that does not define it, and every ``__all__`` entry a module does not
    define, among ``sources`` (module name -> (is a package __init__, source text)). A package's ``__init__`` may
    re-export; an imported submodule (``from pkg import mod``) is not a re-export."""
    trees = {name: ast.parse(text) for name, (_, text) in sources.items()}
    defined = {name: _defined_names(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        is_package = sources[name][0]
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                if base not in sources or sources[base][0]:
                    continue
                for alias in node.names:
                    if alias.name not in defined[base] and f"{base}.{alias.name}" not in sources:
                        found.append(
                            f"{name}:{node.lineno} imports {alias.name} from {base}, which only imports it"
                        )
            elif isinstance(node, ast.Assign) and not is_package and node in tree.body:
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                    listed = [e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant)]
                    found += [
                        f"{name}.__all__ lists {x}, defined elsewhere"
                        for x in listed
                        if x not in defined[name]
                    ]
    return sorted(found)


def _project_sources() -> dict[str, tuple[bool, str]]:
    sources = {}
    for tree in TREES:
        for path in (REPO / tree).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            sources[".".join(parts[:-1] if is_package else parts)] = (is_package, path.read_text())
    return sources


def test_names_come_from_the_module_that_defines_them():
    """Across mmkv, the evals, the app, the benchmarks, training and the tests, a name imported from a module is
    defined there, and a module's ``__all__`` lists only its own names; only a package ``__init__`` re-exports."""
    sources = _project_sources()
    assert {"mmkv.session", "evals.tasks", "tests.test_architecture"} <= sources.keys()
    assert _re_exports(sources) == []


def test_the_re_export_finder_finds_each_form():
    """The checker itself: a name imported through a module that only imports it (absolute and relative), and an
    ``__all__`` naming a foreign name, are reported; a package ``__init__`` and a submodule import are not."""
    sources = {
        "p": (True, "from .a import A\n"),
        "p.a": (False, "A = 1\n"),
        "p.b": (False, "from .a import A\n__all__ = ['A', 'B']\nB = 2\n"),
        "p.c": (False, "from p.b import A, B\nfrom .b import A as C\nfrom p import A\nfrom p import a\n"),
        "p.d": (False, "try:\n    import x\n    D = 1\nexcept ImportError:\n    D = 0\n"),
        "p.e": (False, "from p.d import D\n"),
    }
    assert _re_exports(sources) == [
        "p.b.__all__ lists A, defined elsewhere",
        "p.c:1 imports A from p.b, which only imports it",
        "p.c:2 imports A from p.b, which only imports it",
    ]


def _test_module_imports(sources: dict[str, tuple[bool, str]]) -> list[str]:
    """Imports of one test module (``tests....test_*``) by another module: shared helpers live in
    ``tests.helpers`` (or a folder's ``conftest``), so that running one test file never runs another's setup."""
    found = []
    for name, (_, text) in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                leaf = node.module.rpartition(".")[2]
                if node.module.startswith("tests.") and leaf.startswith("test_"):
                    found.append(f"{name}:{node.lineno} imports {node.module}")
    return sorted(found)


def test_no_module_imports_a_test_module():
    """The shared test helpers have one home (tests/helpers.py); no test, benchmark or eval imports a test
    module; and the checker reports a planted one."""
    assert _test_module_imports(_project_sources()) == []
    planted = {
        "tests.a.test_b": (
            False,
            "from tests.runtime.test_plan import FakeStores\nfrom tests.helpers import X\n",
        )
    }
    assert _test_module_imports(planted) == ["tests.a.test_b:1 imports tests.runtime.test_plan"]


def _has_logic(source: str) -> bool:
    """Whether a module defines any function or method beyond ``__init__`` (a module of records, such as the
    engine's events or the metrics' declarations, has none: nothing there could be wrong on its own)."""
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "__init__"
        for node in ast.walk(ast.parse(source))
    )


def _mirrored_modules() -> list[tuple[str, Path]]:
    """``(package, path)`` of every module under mmkv/runtime, mmkv/serve and mmkv/engine but ``__init__``."""
    return [(package, path) for package in ("runtime", "serve", "engine")
            for path in sorted((PACKAGE / package).glob("*.py")) if path.name != "__init__.py"]  # fmt: skip


def test_test_files_mirror_the_runtime_and_serve_modules():
    """Every module with logic under mmkv/runtime, mmkv/serve and mmkv/engine has its own test file in the
    mirrored folder (tests/runtime/test_<name>.py, ...); root modules' tests sit in tests/."""
    missing = [
        f"mmkv/{package}/{path.name}"
        for package, path in _mirrored_modules()
        if _has_logic(path.read_text()) and not (REPO / "tests" / package / f"test_{path.stem}.py").exists()
    ]
    assert not (REPO / "tests" / "runtime" / "test_toolcalls.py").exists()  # toolcalls is a root module
    assert missing == [], missing


def test_only_modules_of_records_need_no_test_file_of_their_own():
    """The check above exempts exactly the modules that define no function: a record with a method, a function
    at module level or a nested one all count as logic; the exempt ones today are the events and the metrics."""
    assert not _has_logic("@dataclass\nclass A:\n    x: int\n\nclass B:\n    def __init__(self):\n        pass\n")
    for logic in ("def f():\n    pass\n", "class A:\n    def f(self):\n        pass\n",
                  "class A:\n    @property\n    def f(self):\n        return 1\n", "async def f():\n    pass\n",
                  "class A:\n    def __init__(self):\n        def g():\n            pass\n"):  # fmt: skip
        assert _has_logic(logic), logic
    exempt = sorted(f"{package}/{path.name}" for package, path in _mirrored_modules() if not _has_logic(path.read_text()))
    assert exempt == ["engine/events.py", "serve/metrics.py"]
