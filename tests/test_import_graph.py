"""The packages' import graph (issue 35): no module of supervisor/, child/ or shared/ imports, at any level (function-
level and TYPE_CHECKING imports included), a module that imports it back; shared imports neither side, and
supervisor and child never import each other."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("supervisor", "child", "shared")


def _modules() -> dict[str, str]:
    mods = {}
    for pkg in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, pkg)):
            for fn in names:
                if fn.endswith(".py"):
                    path = os.path.join(folder, fn)
                    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    mods[name.removesuffix(".__init__")] = path
    return mods


def _edges(mods: dict[str, str]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                r = resolve(t)
                if r is not None and r != m and not m.startswith(r + "."):  # a package's own __init__: not an edge
                    edges[m].add(r)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_import_circle():
    """No module reaches itself through the imports of the three packages."""
    assert _cycle(_edges(_modules())) is None


def test_the_sides_import_only_shared():
    """shared imports neither supervisor nor child; supervisor and child never import each other."""
    for m, targets in _edges(_modules()).items():
        side = m.split(".")[0]
        others = {t.split(".")[0] for t in targets} - {side, "shared"}
        assert not others, (m, sorted(t for t in targets if t.split(".")[0] in others))
