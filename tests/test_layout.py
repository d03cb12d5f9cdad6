"""The package's parts import downward only, and no module imports itself back through others: each folder of
grpo_fast/ (its docstring says what it may import) sits on a layer, and an import, lazy ones included, runs to
the same or a lower layer; inside rollout/server/ each module of one concern sits on a layer of its own, and
the code that runs inside vLLM imports nothing of grpo-fast's; bench/ sits on top, its sub-packages layered
too.
The graph is read from the source (ast), not from what happens to be imported."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# lowest first; the package's own __init__ / cli / train entry point on top, the benchmarks above it
LAYERS = ["kernels", "tasks", "models", "rewards", "rollout", "trainer", "integrations", "entry", "bench"]
# grpo_fast.rollout.server's modules, lowest first (its __init__ on top)
SERVER = ["vllm_worker", "client", "connect", "ownership", "push", "verify", "adapters", "engine", "serve"]
# bench's modules and sub-packages, lowest first
BENCH = ["_utils", "kernels", "models", "profiles", "learning", "gpu", "report"]


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":  # shipped as grpo_fast.kernels
        parts = ["grpo_fast", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "bench":
        return "bench"
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "entry"  # grpo_fast itself, grpo_fast.cli, grpo_fast.train


def import_graph() -> dict:
    """{module: {imported grpo_fast and bench modules}}, every import of every module (lazy ones too)."""
    files = [
        *(ROOT / "grpo_fast").rglob("*.py"),
        *(ROOT / "kernels").rglob("*.py"),
        *(ROOT / "bench").rglob("*.py"),
    ]
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
                out.update(found or ([target] if target.startswith(("grpo_fast", "bench")) else []))
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith(("grpo_fast", "bench")))
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
    for part in LAYERS[1 : LAYERS.index("entry")]:
        doc = ast.get_docstring(ast.parse((ROOT / "grpo_fast" / part / "__init__.py").read_text()))
        assert doc and "Imports:" in doc, part


def _layered(prefix: str, order: list, top: str) -> list:
    """The imports between modules under `prefix` that run upward in `order` (a module's layer: the first
    name after `prefix`; the package itself on `top`)."""

    def layer(m):
        rest = m[len(prefix) :].lstrip(".").split(".")[0]
        return order.index(rest) if rest else order.index(top) if top in order else len(order)

    upward = []
    for mod, targets in import_graph().items():
        if mod == prefix or mod.startswith(prefix + "."):
            for t in targets:
                if (t == prefix or t.startswith(prefix + ".")) and layer(t) > layer(mod):
                    upward.append(f"{mod} -> {t}")
    return upward


def test_the_server_packages_modules_import_downward_and_vllms_side_imports_nothing_of_ours():
    assert not _layered("grpo_fast.rollout.server", SERVER, top="__init__"), _layered(
        "grpo_fast.rollout.server", SERVER, top="__init__"
    )
    graph = import_graph()
    assert graph["grpo_fast.rollout.server.vllm_worker"] == set()  # it runs inside vLLM's processes
    files = {p.stem for p in (ROOT / "grpo_fast" / "rollout" / "server").glob("*.py")} - {"__init__"}
    assert files == set(SERVER), files  # every module has its layer


def test_benchs_sub_packages_import_downward():
    assert not _layered("bench", BENCH, top="report"), _layered("bench", BENCH, top="report")
    parts = {p.stem for p in (ROOT / "bench").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert parts - {"__init__"} == set(BENCH), parts


def test_the_layout_page_names_every_module_and_the_results_index_every_machine():
    """docs/layout.md names every module of grpo_fast/, kernels/ and bench/ (its file name); the results
    index links every machine's folder, and no folder it links is missing."""
    page = (ROOT / "docs" / "layout.md").read_text()
    modules = [p for d in ("grpo_fast", "kernels", "bench") for p in (ROOT / d).rglob("*.py")]
    unnamed = [str(p.relative_to(ROOT)) for p in modules if p.name != "__init__.py" and p.name not in page]
    assert not unnamed, unnamed
    index = (ROOT / "bench" / "results" / "README.md").read_text()
    folders = {p.name for p in (ROOT / "bench" / "results").iterdir() if p.is_dir()}
    linked = set(re.findall(r"\]\(([\w.-]+)/", index))
    assert folders == linked, (folders, linked)
