"""The package's layers, read from its imports (every import, also those inside functions).

The measurement (harness, timing, the kernel-call split, kernels/, serving/, distributed/) is
below the judgement (gate/) and the step breakdown (attribution/): it takes nothing from them.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "decodebench"
MEASUREMENT = ["harness.py", "timing.py", "kernel_parts.py", "bridge.py", "inject.py", "kernel_rules.py",
               "entry_check.py", "kernels", "serving", "distributed"]


def _modules(*names: str) -> list[Path]:
    paths = [PACKAGE / n for n in names]
    return sorted(p for path in paths for p in ([path] if path.is_file() else path.rglob("*.py")))


def _imported(path: Path) -> set[str]:
    """Absolute names of what ``path`` imports (relative imports resolved against its package)."""
    package = ["decodebench", *path.relative_to(PACKAGE).parent.parts]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def test_every_listed_measurement_module_exists():
    missing = [name for name in MEASUREMENT if not (PACKAGE / name).exists()]
    assert missing == [], f"renamed or removed: {missing} (update MEASUREMENT)"


def test_importing_the_measurement_loads_neither_the_judgement_nor_the_breakdown():
    # what the imports reach, not only what each module names: one fresh interpreter
    import subprocess
    import sys

    modules = sorted({f"decodebench.{p.relative_to(PACKAGE).with_suffix('').as_posix().replace('/', '.')}"
                      for p in _modules(*MEASUREMENT)})
    probe = ("import importlib, sys\n"
             f"for name in {modules!r}: importlib.import_module(name)\n"
             "print(sorted(m for m in sys.modules if m.startswith(('decodebench.gate', 'decodebench.attribution'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_import_reader_resolves_relative_imports(tmp_path):
    assert "decodebench.gate.decision" in _imported(PACKAGE / "gate" / "verdict.py")


@pytest.mark.parametrize("path", _modules(*MEASUREMENT), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_measurement_takes_nothing_from_the_judgement_or_the_breakdown(path):
    upward = sorted(n for n in _imported(path) if n.startswith(("decodebench.gate", "decodebench.attribution")))
    assert upward == [], f"{path.name} imports {upward}"


GATE_MAY_NOT = ("subprocess", "multiprocessing", "pytest", "decodebench.plugin", "decodebench.abplugin",
                "decodebench.runner")


@pytest.mark.parametrize("path", _modules("gate"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_gate_is_a_pure_model_with_no_runner_inside(path):
    runners = sorted(n for n in _imported(path) if n.split(".")[0] in GATE_MAY_NOT or n.startswith(GATE_MAY_NOT))
    assert runners == [], f"{path.name} imports {runners}"


# the one reader and writer of a result's extra_info, and the check of a stored entry's fields
EXTRA_INFO_OWNERS = ("results.py", "entry_check.py")


def _extra_info_uses(path: Path) -> list[int]:
    """Lines of ``path`` that name ``extra_info`` in code: an attribute, a key; not in a docstring."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
                  and isinstance(node.value, ast.Constant)}
    return sorted(node.lineno for node in ast.walk(tree)
                  if (isinstance(node, ast.Attribute) and node.attr == "extra_info")
                  or (isinstance(node, ast.Constant) and node.value == "extra_info" and id(node) not in docstrings))


@pytest.mark.parametrize("path", [p for p in _modules(".") if p.name not in EXTRA_INFO_OWNERS],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_results_module_reads_or_writes_extra_info(path):
    assert _extra_info_uses(path) == [], f"{path.name} reads or writes extra_info (decodebench.results does)"


def test_the_extra_info_check_sees_a_write(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""extra_info is read elsewhere."""\nbench.extra_info.update(x)\ny = d["extra_info"]\n')
    assert _extra_info_uses(module) == [2, 3]


def _module_name(path: Path) -> str:
    parts = ["decodebench", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports: ``from X import a`` is an edge to ``X.a`` where that
    is a module, else to ``X``; a package's ``__init__``, run before any of its modules, is not an edge
    of theirs."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        named = _imported(path)
        graph[name] = {n for n in named if n in paths and not any(m.startswith(f"{n}.") for m in named & paths.keys())
                       and n != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` as the modules along it (the first repeated at the end), or [].

    >>> find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()})
    ['a', 'b', 'c', 'a']
    >>> find_cycle({"a": {"b"}, "b": set()})
    []
    """
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        for nxt in sorted(graph.get(node, ())):
            found = visit(nxt, path + [node])
            if found:
                return found
        done.add(node)
        return []

    for start in sorted(graph):
        found = visit(start, [])
        if found:
            return found
    return []


def test_the_cycle_finder_finds_a_circle_of_two():
    assert find_cycle({"x": {"y"}, "y": {"x"}}) == ["x", "y", "x"]


def test_the_import_graph_sees_imports_inside_functions_and_under_type_checking():
    graph = import_graph()
    assert "decodebench.attribution.predict.step" in graph["decodebench.attribution.predict.whatif"]
    assert "decodebench.attribution.analyse" in graph["decodebench.attribution.cli"]


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle == [], "import circle: " + " -> ".join(cycle)


def test_the_prediction_options_are_declared_once():
    # decodebench/attribution/options.py declares them; the fixtures and every command add them from there.
    # --model and --tp of a pytest session are the plugin's (the deployment benchmarked, recorded in the
    # results' machine_info, which the commands' --model and --tp default to)
    import re

    from decodebench.attribution.options import OPTIONS

    flags = "|".join(re.escape(o.flag) for name, o in OPTIONS.items() if name not in ("model", "tp")) + "|--layers"
    declared = re.compile(rf"\b(?:add|add_argument|addoption)\(\s*[\"']({flags})[\"']")
    sources = [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "fixtures").rglob("*.py")]
    sources.remove(PACKAGE / "attribution" / "options.py")
    elsewhere = sorted(f"{p.relative_to(PACKAGE.parent)}: {m.group(1)}" for p in sources
                       for m in declared.finditer(p.read_text()))
    assert elsewhere == [], elsewhere
    assert "--server-routing" in [o.flag for o in OPTIONS.values()]
