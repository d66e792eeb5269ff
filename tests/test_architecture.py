"""Structural rules of the codebase, checked from the source (see docs/architecture.md).

- no import cycle between modules of `eagle3/`, and none between its packages (directories with an
  `__init__.py`): no two packages import each other, directly or around a longer loop (a package
  contains its subpackages), and none at any package depth (modules grouped by their first d name
  parts: `eagle3.runtime.engine.sequence` -> `eagle3.runtime.engine` at depth 3, so the runtime's
  shared modules and its subpackages point one way). Every import counts: function-level ones, and
  typing-only ones under `if TYPE_CHECKING:` (a type two modules each name is a dependency both
  ways even where Python never runs the import; such a loop became a run-time cycle before);
- no product file over 800 lines;
- no function over 150 lines (Triton kernels excepted);
- docs/architecture.md's layer diagrams match the imports;
- the repository never cites documents that a clone does not have, nor a path of the machine it was
  written on.

Each test reads the source with `ast`; nothing is imported, so a failure names the
offending module, file or function rather than crashing on import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "eagle3"
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 150
# Triton kernels are long straight-line programs by nature; they are exempt from the
# function-length rule (not from the file-length rule).
FUNCTION_LENGTH_EXEMPT = (PKG / "runtime" / "kernels" / "triton",)


def _product_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in _product_files()}


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    # A module's level-1 anchor is its package; a package's own __init__ is its anchor.
    drop = node.level - 1 if is_package else node.level
    base = base[: len(base) - drop] if drop else base
    return ".".join(base + ([node.module] if node.module else []))


def _owning_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that `name` is or lies inside (`a.b.c` -> `a.b`)."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


# Built once per package tree: four tests read the real one, and parsing eagle3/ takes about a second.
_GRAPHS: dict[tuple[Path, Path], dict[str, set[str]]] = {}


def import_graph() -> dict[str, set[str]]:
    """module -> the eagle3 modules it imports anywhere in its body (functions and `if
    TYPE_CHECKING:` blocks included). A copy: callers may change it."""
    if (ROOT, PKG) not in _GRAPHS:
        _GRAPHS[(ROOT, PKG)] = _build_import_graph()
    return {m: set(t) for m, t in _GRAPHS[(ROOT, PKG)].items()}


def _build_import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve_from(mod, is_package, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    # `from pkg import name` imports the submodule when name is one.
                    targets.append(sub if sub in modules else base)
            for t in targets:
                if not t.startswith("eagle3"):
                    continue
                owner = _owning_module(t, modules)
                if owner and owner != mod:
                    graph[mod].add(owner)
                    # Importing a.b.c runs a/__init__ and a/b/__init__ first.
                    parts = owner.split(".")
                    for i in range(1, len(parts)):
                        parent = ".".join(parts[:i])
                        if parent in modules and parent != mod and not mod.startswith(parent + "."):
                            graph[mod].add(parent)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of size > 1 (Tarjan), each as one cycle path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        # Iterative DFS: the module graph is deep enough to matter for recursion limits.
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def _cycle_path(graph: dict[str, set[str]], comp: list[str], start: str) -> list[str]:
    """The shortest cycle through `start` inside its strongly connected component."""
    members = set(comp)
    # BFS from start's successors back to start, within the component.
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def describe_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per distinct elementary cycle found (shortest through each member)."""
    lines: list[str] = []
    seen: set[frozenset[str]] = set()
    for comp in find_cycles(graph):
        for start in comp:
            path = _cycle_path(graph, comp, start)
            key = frozenset(path)
            if key not in seen:
                seen.add(key)
                lines.append("import cycle: " + " -> ".join(path))
    return lines


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert describe_cycles(graph) == ["import cycle: a -> b -> c -> a"]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_typing_only_and_function_level_imports_are_edges(tmp_path, monkeypatch):
    pkg = tmp_path / "eagle3"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "b.py", "sub/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "sub" / "c.py").write_text("def f():\n    from eagle3 import b\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from eagle3.sub.c import f\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)  # import_graph reads this planted package
    monkeypatch.setitem(globals(), "PKG", pkg)
    g = import_graph()
    assert g["eagle3.a"] == {"eagle3.sub.c", "eagle3.sub"} and g["eagle3.sub.c"] == {"eagle3.b"}


def test_relative_imports_resolve():
    node = ast.parse("from ..x import y", mode="exec").body[0]
    assert _resolve_from("eagle3.serve.app", False, node) == "eagle3.x"
    assert _resolve_from("eagle3.serve", True, node) == "eagle3.x"
    node = ast.parse("from . import y", mode="exec").body[0]
    assert _resolve_from("eagle3.serve.app", False, node) == "eagle3.serve"


def test_no_import_cycle_in_eagle3():
    lines = describe_cycles(import_graph())
    msg = "\n".join(lines)
    assert not lines, f"import cycles in eagle3/ (function-level and typing-only imports count):\n{msg}"


def at_depth(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The module graph with every module grouped under its first ``depth`` name parts
    (``eagle3.runtime.engine.sequence`` -> ``eagle3.runtime.engine`` at depth 3); a shorter name
    stays itself. Imports inside a group are dropped."""
    def group(m: str) -> str:
        return ".".join(m.split(".")[:depth])

    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        g = group(mod)
        out.setdefault(g, set())
        for t in targets:
            out.setdefault(group(t), set())
            if group(t) != g:
                out[g].add(group(t))
    return out


def test_grouping_by_depth_finds_a_cycle_through_shared_modules():
    # the shape: an engine module and a runtime-level module name each other (a typing-only
    # import is enough); no module-level cycle, but the groups at depth 3 import each other
    graph = {"eagle3.rt.engine.seq": {"eagle3.rt.logprobs"}, "eagle3.rt.engine.runner": {"eagle3.rt.sampling"},
             "eagle3.rt.sampling": {"eagle3.rt.logprobs"}, "eagle3.rt.logprobs": {"eagle3.rt.engine.runner"}}
    assert find_cycles(graph) == [["eagle3.rt.engine.runner", "eagle3.rt.logprobs", "eagle3.rt.sampling"]]
    graph["eagle3.rt.logprobs"] = {"eagle3.rt.engine.util"}
    graph["eagle3.rt.engine.util"] = set()
    assert find_cycles(graph) == []
    assert find_cycles(at_depth(graph, 3)) == [["eagle3.rt.engine", "eagle3.rt.logprobs", "eagle3.rt.sampling"]]
    assert find_cycles(at_depth(graph, 2)) == []  # one group


def test_no_import_cycle_at_any_package_depth():
    graph = import_graph()
    deepest = max(m.count(".") + 1 for m in graph)
    lines = [f"depth {d}: {line}" for d in range(2, deepest) for line in describe_cycles(at_depth(graph, d))]
    assert not lines, ("modules grouped by package import each other (move the shared type or function to "
                       "the lower one; typing-only imports count):\n" + "\n".join(lines))


def _packages() -> list[str]:
    return sorted(m for m, p in _modules().items() if p.name == "__init__.py")


def _contains(package: str, module: str) -> bool:
    return module == package or module.startswith(package + ".")


def package_graph(graph: dict[str, set[str]], packages: list[str] | None = None) -> dict[str, set[str]]:
    """package -> the packages it imports, from the module graph: P imports Q when a module inside P
    (its subpackages included) imports a module inside Q. Only pairs where neither package contains
    the other count: a package may use its own parent's modules (``runtime/layers`` -> ``runtime/
    config.py``) and a parent its subpackages; between siblings and cousins the imports go one way."""
    packages = _packages() if packages is None else packages
    out: dict[str, set[str]] = {p: set() for p in packages}
    for mod, targets in graph.items():
        src = [p for p in packages if _contains(p, mod)]
        for t in targets:
            for q in packages:
                if not _contains(q, t):
                    continue
                for p in src:
                    if not _contains(p, q) and not _contains(q, p):
                        out[p].add(q)
    return out


def test_package_graph_of_a_planted_pair():
    graph = {"eagle3.a.x": {"eagle3.b.y"}, "eagle3.b.y": {"eagle3.a.z"}, "eagle3.a.z": set(),
             "eagle3.a.sub.w": {"eagle3.a.x"}, "eagle3.a.x2": {"eagle3.a.sub.w"}}
    pg = package_graph(graph, ["eagle3", "eagle3.a", "eagle3.a.sub", "eagle3.b"])
    assert pg["eagle3.a"] == {"eagle3.b"} and pg["eagle3.b"] == {"eagle3.a"}  # a pair: a cycle
    assert pg["eagle3.a.sub"] == set() and pg["eagle3"] == set()  # parent <-> child: not counted
    assert find_cycles(pg) == [["eagle3.a", "eagle3.b"]]


def test_no_import_cycle_between_packages():
    pg = package_graph(import_graph())
    lines = [line.replace("import cycle", "package cycle") for line in describe_cycles(pg)]
    assert not lines, ("packages importing each other in eagle3/ (move the module to the package it belongs "
                       "to, or put a typing-only import under `if TYPE_CHECKING:`):\n" + "\n".join(lines))


def test_no_product_file_over_800_lines():
    long = []
    for p in _product_files():
        n = len(p.read_text().splitlines())
        if n > MAX_FILE_LINES:
            long.append(f"{p.relative_to(ROOT)}: {n} lines")
    assert not long, f"product files over {MAX_FILE_LINES} lines (split by concept):\n" + "\n".join(long)


def test_no_function_over_150_lines():
    long = []
    for p in _product_files():
        if any(p.is_relative_to(d) for d in FUNCTION_LENGTH_EXEMPT):
            continue
        tree = ast.parse(p.read_text(), filename=str(p))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines outside eagle3/runtime/kernels/triton/:\n"
        + "\n".join(long)
    )


def test_no_citation_of_documents_outside_the_repository():
    needles = ("shared/docs", "DESIGN.md")
    files = [p for p in PKG.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    files += [p for p in (ROOT / "docs").rglob("*") if p.is_file() and p.suffix in (".md", ".txt", ".py")]
    files.append(ROOT / "README.md")
    hits = []
    for p in files:
        try:
            text = p.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if any(n in line for n in needles):
                hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, (
        "citations of documents a clone does not have (cite docs/architecture.md or files in the repo):\n"
        + "\n".join(hits)
    )


# Paths of the machine the repository was written on: a clone has none of them.
_MACHINE_PATHS = ("/work/", "../shared", "/home/", "/root/", "/Users/")


def test_no_test_or_doc_names_a_path_outside_the_repository():
    files = [p for p in (ROOT / "tests").rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".json")]
    files += [p for p in (ROOT / "docs").rglob("*") if p.is_file() and p.suffix in (".md", ".txt", ".py")]
    files += [p for p in (ROOT / "benchmarks").rglob("*.py")]
    files += [p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts]
    files.append(ROOT / "README.md")
    me = Path(__file__).resolve()
    hits = []
    for p in files:
        if p.resolve() == me or "__pycache__" in p.parts:
            continue
        try:
            text = p.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if any(n in line for n in _MACHINE_PATHS):
                hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not hits, "paths outside the repository (use a placeholder such as $VLLM_PYTHON):\n" + "\n".join(hits)


def drawn_layers(text: str) -> list[list[list[str]]]:
    """The layer diagrams of docs/architecture.md's "Layers" section: per code block, its rows from
    the top, each row the packages it names (``runtime/engine/`` -> ``eagle3.runtime.engine``)."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```")[1::2]
    out = []
    for block in blocks:
        rows = []
        for line in block.splitlines():
            names = []
            for token in line.split():
                if not re.fullmatch(r"[a-z_]+(/[a-z_]+)*/", token):
                    break
                names.append("eagle3." + token.rstrip("/").replace("/", "."))
            if names:
                rows.append(names)
        out.append(rows)
    return out


def test_drawn_layers_parse() -> None:
    text = "# x\n\n## Layers\n\n```\ncli/   the CLI\n  |\nserve/  plan/   two\n```\n\n## Next\n"
    assert drawn_layers(text) == [[["eagle3.cli"], ["eagle3.serve", "eagle3.plan"]]]


def test_architecture_md_draws_the_imports_as_they_are() -> None:
    """Every import between two drawn packages goes from a row to a row below it, and every top-level
    package is drawn (docs/architecture.md, "Layers")."""
    diagrams = drawn_layers((ROOT / "docs" / "architecture.md").read_text())
    pg = package_graph(import_graph())
    top = {p for p in _packages() if p.count(".") == 1}
    assert diagrams and top == {name for row in diagrams[0] for name in row}, "docs/architecture.md's first diagram"
    wrong = []
    for rows in diagrams:
        row_of = {name: i for i, row in enumerate(rows) for name in row}
        assert set(row_of) <= set(_packages()), f"drawn but not a package: {sorted(set(row_of) - set(_packages()))}"
        for p in row_of:
            for q in pg[p]:
                if q in row_of and row_of[q] <= row_of[p]:
                    wrong.append(f"{p} (row {row_of[p] + 1}) imports {q} (row {row_of[q] + 1})")
    assert not wrong, "docs/architecture.md draws these imports the other way round:\n" + "\n".join(wrong)
