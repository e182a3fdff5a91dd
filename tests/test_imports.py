"""The package's imports point one way (ARCHITECTURE.md "Layers").

Parses every module of ``embedscale`` (ast, nothing imported) and builds the graph of its imports of
``embedscale`` modules, module-level and inside functions alike (a circle through a function-level import is a
circle that only waits for the wrong call order). Importing ``a.b.c`` also runs ``a`` and ``a.b`` first, unless
the importer lives inside them, so a package ``__init__`` that pulls in a module which imports a sibling of the
package closes a circle too; a module that imports a name from its own package's ``__init__`` does as well. Checks: no
circle of modules and none of folders (two folders never import each other); at most 2 function-level imports of
embedscale modules, each with a comment saying why; every module sits in one layer of ``LAYERS`` and imports only
from its own layer or the layers below it, with no exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "embedscale"
MAX_FUNCTION_LEVEL = 2

# top to bottom; a module's layer is its top-level name under embedscale (a folder or a module)
LAYERS = [
    ("__main__",),
    ("cli",),
    ("workflow", "calibrate", "calibrate_ranks", "towers", "doctor"),  # what the commands run
    ("serve",),
    ("train",),
    ("assemble",),
    ("models",),
    ("embedding", "pipeline"),  # the executors
    ("comm",),
    ("reorder",),
    ("plan",),  # numpy only (tests/test_architecture.py)
    ("data",),
    ("specs", "units", "io", "errors", "threads", "device", "storage"),
]
LEVEL = {name: len(LAYERS) - i for i, names in enumerate(LAYERS) for name in names}


def module_name(p: Path) -> str:
    parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def scan(root: Path = PKG):
    """``(modules, imports)``: every module name, and for every import of an embedscale module
    ``(importer, line, targets, in_function, commented)``."""
    files = {module_name(p): p for p in sorted(root.rglob("*.py"))}
    imports = []
    for name, p in files.items():
        text = p.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = name.split(".") if p.name == "__init__.py" else name.split(".")[:-1]
                    mod = ".".join(base[:len(base) - n.level + 1] + ([n.module] if n.module else []))
                else:
                    mod = n.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod for a in n.names]
            else:
                continue
            targets = [t for t in targets if t == "embedscale" or t.startswith("embedscale.")]
            if targets:
                seg = lines[n.lineno - 1:n.end_lineno]
                commented = any("#" in s for s in seg) or lines[n.lineno - 2].strip().startswith("#")
                imports.append((name, n.lineno, targets, id(n) in in_function, commented))
    return files, imports


def graph(files, imports) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in files}
    for name, _, targets, _, _ in imports:
        for t in targets:
            parts = t.split(".")
            for k in range(1, len(parts) + 1):
                q = ".".join(parts[:k])
                implicit = k < len(parts)  # a package run on the way to its submodule
                if q in files and q != name and not (implicit and name.startswith(q + ".")):
                    g[name].add(q)
    return g


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_circle_detection_can_fail():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    files = {"embedscale.x": None, "embedscale.x.y": None, "embedscale.z": None}
    # x/__init__ imports x.y, x.y imports z, z imports x.y: z runs x/__init__ first -> circle x, x.y, z
    imports = [("embedscale.x", 1, ["embedscale.x.y"], False, False), ("embedscale.x.y", 1, ["embedscale.z"], False, False),
               ("embedscale.z", 1, ["embedscale.x.y"], False, False)]
    assert circles(graph(files, imports)) == [["embedscale.x", "embedscale.x.y", "embedscale.z"]]


def test_no_import_circle():
    files, imports = scan()
    found = circles(graph(files, imports))
    assert not found, f"import circles: {found}"


def test_few_function_level_imports_each_commented():
    _, imports = scan()
    inner = [(m, line, t) for m, line, t, in_function, _ in imports if in_function]
    assert len(inner) <= MAX_FUNCTION_LEVEL, f"{len(inner)} function-level imports of embedscale modules: {inner}"
    silent = [(m, line) for m, line, _, in_function, commented in imports if in_function and not commented]
    assert not silent, f"function-level imports without a comment saying why: {silent}"


def top(module: str) -> str:
    """``embedscale.plan.auto`` -> ``plan``; the package itself -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import from a lower layer to a higher one, and every module in no layer."""
    bad = []
    for m, deps in g.items():
        if top(m) and top(m) not in LEVEL:
            bad.append(f"{m}: in no layer of LAYERS")
            continue
        for d in deps:
            if top(d) and top(m) and top(d) != top(m) and LEVEL.get(top(d), 1 << 30) > LEVEL[top(m)]:
                bad.append(f"{m} -> {d}")
    return sorted(bad)


def folders(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph of top-level names: a folder imports another when any of its modules does."""
    out: dict[str, set[str]] = {}
    for m, deps in g.items():
        out.setdefault(top(m), set()).update(top(d) for d in deps if top(d) != top(m))
    return out


def test_layer_checks_can_fail():
    g = {"embedscale.comm.x": {"embedscale.embedding.init"}, "embedscale.embedding.init": set(),
         "embedscale.plan.y": {"embedscale.data.z"}, "embedscale.data.z": set(), "embedscale.nowhere": set()}
    assert upward(g) == ["embedscale.comm.x -> embedscale.embedding.init", "embedscale.nowhere: in no layer of LAYERS"]
    pair = {"embedscale.embedding.a": {"embedscale.pipeline.b"}, "embedscale.pipeline.b": set(),
            "embedscale.pipeline.c": {"embedscale.embedding.d"}, "embedscale.embedding.d": set()}
    assert circles(pair) == [] and circles(folders(pair)) == [["embedding", "pipeline"]]


def test_layers_point_down():
    """Every import goes to the importer's own layer or a lower one (LAYERS), with no exception."""
    files, imports = scan()
    bad = upward(graph(files, imports))
    assert not bad, "imports that point up: " + ", ".join(bad)


def test_no_two_folders_import_each_other():
    files, imports = scan()
    found = circles(folders(graph(files, imports)))
    assert not found, f"folders that import each other: {found}"
