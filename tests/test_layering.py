"""The layering, read from the imports (ops < memory, modules, optim, quant < hf < compat, decode < the package
root, with tigon.patch and tigon.unpatch < cli): every import (module level, inside a function, or by
importlib.import_module("tigon....")) points down the list below or stays within its own package, ops/ needs torch
and Triton only, and no two modules import each other through any chain. The package and the checkout's benchmarks/
stand side by side at the top: tigon never imports them (`tigon bench` runs `python -m benchmarks NAME` as a child
process), and they never import tigon.cli."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "tigon"
BENCHMARKS = SRC.parent / "benchmarks"
# lowest first; a module may import its own package and those of lower layers, never one of its own layer
LAYERS = [("ops", "_log"), ("memory", "modules", "optim", "quant"), ("hf",), ("compat", "decode"), ("__init__",),
          ("cli",)]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
OPS_MAY_IMPORT = {"torch", "triton", "numpy"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of everything `path` imports, relative imports resolved."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from . import x` imports module x
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        # a submodule's `from . import x` names its package only to reach x: no edge to the package's face
        edges[name] = {m for m in _imports(path) if m in modules and m != name and not name.startswith(m + ".")}
    return modules, edges


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_imports_point_down():
    modules, edges = _graph()
    unknown = sorted({_area(m) for m in modules} - RANK.keys())
    assert not unknown, f"areas with no layer in LAYERS: {unknown}"
    upward = [f"{a} -> {b}" for a, bs in edges.items() for b in bs
              if _area(a) != _area(b) and RANK[_area(b)] >= RANK[_area(a)]]
    assert not upward, f"imports that do not point down: {sorted(upward)}"


def test_ops_needs_torch_and_triton_only():
    bad = []
    for path in (PACKAGE / "ops").rglob("*.py"):
        for name in _imports(path):
            top = name.split(".")[0]
            if top == "tigon" and not name.startswith("tigon.ops"):
                bad.append(f"{_module_name(path)} -> {name}")
            elif top in {"transformers", "peft", "trl", "accelerate"} or name.startswith("torch.nn.modules"):
                bad.append(f"{_module_name(path)} -> {name}")
            elif top not in OPS_MAY_IMPORT | {"tigon", "__future__"} and not _stdlib(top):
                bad.append(f"{_module_name(path)} -> {name}")
    assert not bad, bad


def _stdlib(top: str) -> bool:
    import sys

    return top in sys.stdlib_module_names


def test_no_cycles():
    _, edges = _graph()
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
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
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles: {cycles}"


def _absolute_imports(path: Path) -> set[str]:
    """Every module name an absolutely-importing file names: `import a.b`, `from a import b` (as a and a.b), and
    importlib.import_module("a.b")."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def test_the_package_never_imports_the_benchmarks():
    # The benchmarks are a checkout's tools, not installed with tigon: `tigon bench` starts them as a process.
    bad = [f"{_module_name(p)} -> {name}" for p in sorted(PACKAGE.rglob("*.py")) for name in _imports(p)
           if name.split(".")[0] == "benchmarks"]
    assert not bad, bad


def test_the_benchmarks_never_import_the_command():
    # They measure the library; the `tigon` command launches them, so an import of tigon.cli would point back up.
    files = sorted(BENCHMARKS.rglob("*.py"))
    assert len(files) > 10
    bad = [f"{p.relative_to(BENCHMARKS.parent)} -> {name}" for p in files for name in _absolute_imports(p)
           if name == "tigon.cli" or name.startswith("tigon.cli.")]
    assert not bad, bad
