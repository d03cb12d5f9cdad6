"""The package's parts import downward only, and no module imports itself back through others: each folder of
grpo_fast/ (its docstring says what it may import) sits on a layer, and an import, lazy ones included, runs to
the same or a lower layer. The graph is read from the source (ast), not from what happens to be imported."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# lowest first; the package's own __init__ / cli / train entry point on top
LAYERS = ["kernels", "tasks", "models", "rewards", "rollout", "trainer", "integrations", "entry"]


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":
        parts = ["grpo_fast", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "entry"  # grpo_fast itself, grpo_fast.cli, grpo_fast.train


def import_graph() -> dict:
    """{module: {imported grpo_fast modules}}, every import statement of every module (lazy ones too)."""
    files = [*(ROOT / "grpo_fast").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
    modules = {_module(f): f for f in files}
    graph = {}
    for mod, f in modules.items():
        package = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" for a in node.names]
                found = [n for n in names if n in modules]  # `from pkg import module`
                out.update(found or ([target] if target.startswith("grpo_fast") else []))
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("grpo_fast"))
        graph[mod] = {t for t in out if t != mod}
    return graph


def test_imports_run_downward_only():
    upward = []
    for mod, targets in import_graph().items():
        for t in targets:
            if LAYERS.index(_part(t)) > LAYERS.index(_part(mod)):
                upward.append(f"{mod} -> {t}")
    assert not upward, upward


def test_no_import_circle():
    graph = import_graph()
    # a package's __init__ importing its own submodules is not a circle with them importing the package's
    # other names: count module -> module edges, a package's own submodules excluded from its edges
    edges = {m: {t for t in ts if t in graph and not t.startswith(m + ".")} for m, ts in graph.items()}
    state, circles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                circles.append(stack[stack.index(t) :] + [t] if t in stack else [m, t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not circles, circles


def test_every_part_says_what_it_may_import():
    for part in LAYERS[1:-1]:
        doc = ast.get_docstring(ast.parse((ROOT / "grpo_fast" / part / "__init__.py").read_text()))
        assert doc and "Imports:" in doc, part
