"""The pipeline's layering: imports go one way, down the pipeline, and never in a circle.

Every import in tuner/ and proposer/ counts, those inside functions too (an import deferred
into a function is still a dependency). A module may import its own package's modules and
any lower layer; an import of a higher layer, or any cycle between modules, fails here with
the offending import named.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Lowest first. A module belongs to the longest prefix that names it.
LAYERS = ["tuner.version", "tuner.errors", "tuner.space", "tuner.build", "tuner.measure", "tuner.search",
          "tuner.results", "tuner.runtime", "tuner.api", "proposer", "tuner.cli", "tuner"]


def modules() -> dict[str, Path]:
    found = {}
    for top in ("tuner", "proposer"):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS.index(best)


def imports(path: Path, name: str, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported module of ours, line) for every import statement in the file."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            # `from pkg import mod` imports the submodule pkg.mod where one exists
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import tuner.x.y` depends on the module that exists
                t = t.rpartition(".")[0]
            if t and t != name:
                out.append((t, node.lineno))
    return out


def graph() -> dict[str, list[tuple[str, int]]]:
    known = modules()
    return {name: imports(path, name, known) for name, path in known.items()}


def test_every_import_goes_down_the_pipeline():
    upward = []
    for src, targets in graph().items():
        for dst, line in targets:
            if layer(dst) > layer(src):
                upward.append(f"{modules()[src].relative_to(ROOT)}:{line}: {src} imports {dst}, a higher layer "
                              f"({LAYERS[layer(src)]} < {LAYERS[layer(dst)]})")
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    g = {src: sorted({dst for dst, _ in targets}) for src, targets in graph().items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in g.get(node, []):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path
                              else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_runtime_needs_no_search():
    """Loading exported kernels pulls in neither Optuna nor the search (a program that runs our
    kernels should not carry the tuner)."""
    import subprocess
    import sys

    code = ("import sys, tuner, tuner.runtime; "
            "bad = [m for m in ('optuna', 'tuner.search', 'tuner.api', 'typer') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_layers_cover_every_module():
    """Every module of ours has a layer: a new top-level package must be placed in LAYERS."""
    for name in modules():
        assert any(name == p or name.startswith(p + ".") for p in LAYERS), name
