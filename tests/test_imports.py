"""The package's imports point one way (issue 13 part 3, ../shared/ARCHITECTURE.md "Layers").

Parses every module of ``embedscale`` (ast, nothing imported) and builds the graph of its imports of
``embedscale`` modules, module-level and inside functions alike (a circle through a function-level import is a
circle that only waits for the wrong call order). Importing ``a.b.c`` also runs ``a`` and ``a.b`` first, unless
the importer lives inside them, so a package ``__init__`` that pulls in a module which imports a sibling of the
package closes a circle too; a module that imports a name from its own package's ``__init__`` does as well. Checks: no circle; fewer than 20 function-level imports of embedscale modules, each
with a comment saying why; the planner (numpy) and the executors never import what sits above them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "embedscale"
MAX_FUNCTION_LEVEL = 20


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
    assert len(inner) < MAX_FUNCTION_LEVEL, f"{len(inner)} function-level imports of embedscale modules: {inner}"
    silent = [(m, line) for m, line, _, in_function, commented in imports if in_function and not commented]
    assert not silent, f"function-level imports without a comment saying why: {silent}"


def test_layers_point_down():
    """The planner imports no executor; executors import no run loop, assembly, orchestration or CLI."""
    files, imports = scan()
    g = graph(files, imports)
    below = {"plan": ("embedding", "comm", "pipeline", "models", "train", "towers", "assemble", "workflow", "cli"),
             "data": ("embedding", "comm", "pipeline", "models", "train", "towers", "assemble", "workflow", "cli", "plan"),
             "embedding": ("models", "train", "assemble", "workflow", "cli"),
             "comm": ("pipeline", "models", "train", "assemble", "workflow", "cli"),
             "pipeline": ("models", "train", "assemble", "workflow", "cli"),
             "models": ("train", "assemble", "workflow", "cli"),
             "assemble": ("train", "workflow", "cli"),
             "train": ("workflow", "cli"),
             "serve": ("workflow", "cli")}
    bad = []
    for m, deps in g.items():
        layer = m.split(".")[1] if "." in m else ""
        for d in deps:
            top = d.split(".")[1] if "." in d else ""
            if top in below.get(layer, ()):
                bad.append(f"{m} -> {d}")
    assert not bad, "imports that point up: " + ", ".join(sorted(bad))
