"""The house rules a reader relies on, checked on the source: no import circle anywhere (lazy and type-only imports
count), packages of a readable size, and the decoder's layers importing only downwards (the core never imports the
server, the evaluation or the command lines), and no test module importing another (what tests share lives in
the tests/kit package and tests/conftest.py)."""

import ast
import functools
import os
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("spd_lightning", "inference", "callbacks", "tests/kit")
MAX_FILES_PER_PACKAGE = 16  # the bar the decoder refactor set: no package folder over 16 modules
# inference's layers, lowest first: a module may import its own layer and the layers below, never above.
LAYERS = [
    ("inference.sampling",),
    ("inference.runtime",),
    ("inference.cycle",),
    ("inference.processes", "inference.chain"),
    ("inference.prompts", "inference.setup", "inference.backends", "inference.textstream"),
    ("inference.serving", "inference.evaluation", "inference.cli"),
    ("inference.decode", "inference.eval", "inference.serve", "inference.plan"),
]


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the first-party modules it imports anywhere in its body (inside functions and TYPE_CHECKING too);
    parsed once per session (read-only: callers must not change it)."""
    mods = modules()
    graph = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name and not name.startswith(t + "."))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circle():
    assert cycles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def layer_of(module: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in layer):
            return i
    return None


@pytest.mark.parametrize("module", sorted(m for m in modules() if layer_of(m) is not None))
def test_the_decoder_imports_only_downwards(module):
    graph = import_graph()
    upward = [t for t in graph[module] if (layer_of(t) or 0) > layer_of(module)]
    assert upward == [], f"{module} imports a higher layer: {upward}"


def test_no_package_folder_is_a_flat_room():
    for package in PACKAGES:
        for folder, _, files in os.walk(REPO / package):
            count = len([f for f in files if f.endswith(".py") and f != "__init__.py"])
            assert count <= MAX_FILES_PER_PACKAGE, f"{folder} holds {count} modules: split it by concept"


TEST_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w., ]+))", re.MULTILINE)


def imported_test_modules(source: str) -> set[str]:
    """The `test_*` modules a source imports, on any line: inside functions, and in the scripts a test hands to a
    child process as a string (which `ast` does not see as imports)."""
    names = set()
    for match in TEST_IMPORT.finditer(source):
        names.update(n.strip().split(" ")[0] for n in (match[1] or match[2]).split(","))
    return {name for name in names if name.split(".")[-1].startswith("test_")}


@pytest.mark.parametrize("path", sorted((REPO / "tests").glob("*.py")), ids=lambda p: p.name)
def test_no_test_module_imports_another(path):
    assert imported_test_modules(path.read_text()) == set(), f"{path.name}: move what is shared to tests/kit/"


def test_the_test_import_finder_finds_one():
    source = 'import os, test_geometry\nfrom test_loss import x\nSCRIPT = """\n    import test_serve as s\n"""\n'
    assert imported_test_modules(source) == {"test_geometry", "test_loss", "test_serve"}
