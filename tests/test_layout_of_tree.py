"""The same rooms in every backend folder, the shared maths once, and a harness that names no backend:
checked on the source tree (files, ast and text; nothing is imported or run).

* every wrappers/<backend>/ folder holds the same modules: __init__ (the Entry and its capabilities), layers,
  optim, parallel, backend; Keras' per-backend code is one subpackage (runtimes/) whose modules define the
  same names; no wrapper class picks its own class in `__new__`;
* the layout, permutation and pooling-size maths are defined once, in algorithms/layout.py; the fault
  constants once, in algorithms/faults.py;
* no module under harness/ names a backend, outside the matrix defaults (harness/matrices/*.toml, read by
  harness/defaults.py): a plain grep of every line, prose included;
* no module imports another module's private name, and the project's modules import each other without a
  cycle (lazy imports inside functions count too: a cycle broken by deferring an import is still one).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WRAPPERS = ROOT / "wrappers"
MODULE_SET = {"__init__", "layers", "optim", "parallel", "backend"}
# subpackages a backend folder may hold beyond its modules, and why
SUBPACKAGES = {"keras": {"runtimes": "one module per Keras backend (jax, tensorflow, torch), the same names in each"}}
BACKEND_WORDS = ("torch", "jax", "tensorflow", "keras")     # and keras-<backend>, numpy is also an array library
BACKEND_RE = re.compile(r"(?<![A-Za-z_./])(torch|jax|tensorflow|keras(?:-(?:jax|tensorflow|torch))?)(?![A-Za-z_])")
# harness lines naming a backend in prose that belongs to someone else's change right now -> why it stays
KNOWN_HARNESS_LINES: dict[str, str] = {}


def backend_folders() -> list[Path]:
    return sorted(p for p in WRAPPERS.iterdir() if p.is_dir() and (p / "__init__.py").exists())


def test_every_backend_folder_has_the_same_modules():
    folders = backend_folders()
    assert {p.name for p in folders} >= {"torch", "jax", "tensorflow", "keras", "numpy"}
    for folder in folders:
        modules = {p.stem for p in folder.glob("*.py")}
        assert modules == MODULE_SET, f"wrappers/{folder.name}/: {sorted(modules)} != {sorted(MODULE_SET)}"
        subs = {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        assert subs == set(SUBPACKAGES.get(folder.name, {})), f"wrappers/{folder.name}/ subpackages: {sorted(subs)}"


def test_no_wrapper_class_swaps_itself_in_new():
    """The class that runs a job is chosen where it is constructed (a backend's `for_options`, asked by
    wrappers/worker.py), not by a `__new__` that returns another class."""
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted(WRAPPERS.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(node, ast.FunctionDef) and node.name == "__new__"]
    assert not found, f"__new__ in wrappers/: {found}"


def top_level_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return {n for n in out if not n.startswith("_")}


def test_keras_runtimes_offer_the_same_names():
    """What the Keras backend asks of its runtime (the module of the running Keras backend)."""
    asked = {"train_step", "step_with_gradients", "Stepper", "make_parallel", "no_grad", "setup", "versions", "devices",
             "jit_options", "enable_float64", "FLOAT64_REFUSAL", "FLOAT64_NOTE", "SYNCHRONIZED_BN",
             "REPLICA_GRADIENTS_SUMMED", "AVGPOOL_SAME_REPLICATES"}
    for path in sorted((WRAPPERS / "keras" / "runtimes").glob("*.py")):
        if path.stem != "__init__":
            missing = asked - top_level_names(path)
            assert not missing, f"{path.relative_to(ROOT)} lacks {sorted(missing)}"
    backend = (WRAPPERS / "keras" / "backend.py").read_text()
    assert not re.search(r"KBACKEND\s*==", backend), "keras/backend.py branches on the Keras backend's name"


SHARED = {"flatten_perm", "layer_of", "_layer_of", "to_native", "from_native", "ceil_pool_pad", "_ceil_pool_pad",
          "ceil_pool_out", "torch_ceil_pool_out", "same_pads", "_pads", "window_counts", "flat_sources",
          "flat_to_canonical", "flat_from_canonical"}


def definitions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_layout_and_pooling_maths_are_defined_once():
    where: dict[str, list[str]] = {}
    for path in sorted([*WRAPPERS.rglob("*.py"), *(ROOT / "algorithms").rglob("*.py")]):
        for name in definitions(path) & SHARED:
            where.setdefault(name, []).append(str(path.relative_to(ROOT)))
    twice = {n: w for n, w in where.items() if w != ["algorithms/layout.py"]}
    assert not twice, f"layout/pooling maths outside algorithms/layout.py: {twice}"


def test_fault_constants_are_defined_once():
    for path in sorted(WRAPPERS.rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"\b1e-3\b", text), f"{path.relative_to(ROOT)}: a literal 1e-3 (Keras BN eps: faults.KERAS_BN_EPS)"
        for m in re.finditer(r"label_smoothing", text):
            line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.end())]
            assert "0.1" not in line, f"{path.relative_to(ROOT)}: {line.strip()} (faults.LABEL_SMOOTHING)"


def harness_lines_naming_a_backend() -> list[str]:
    out = []
    for path in sorted((ROOT / "harness").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "harness/defaults.py" or rel in KNOWN_HARNESS_LINES:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if BACKEND_RE.search(line):
                out.append(f"{rel}:{i}: {line.strip()}")
    return out


def test_no_harness_module_names_a_backend_even_in_prose():
    offenders = harness_lines_naming_a_backend()
    assert not offenders, "harness lines naming a backend (harness/defaults.py and the matrices are the place):\n" \
        + "\n".join(offenders)


def test_the_grep_sees_a_backend_name():
    assert BACKEND_RE.search('help="torch | jax"') and BACKEND_RE.search("duipai check --fault keras-jax:x")
    assert not BACKEND_RE.search("the torch_layout helper") and not BACKEND_RE.search("tf.function / jit")


# --------------------------------------------------------------------------- imports
PACKAGES = ("algorithms", "harness", "wrappers")


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for the three packages."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imported_names(path: Path, module: str) -> list[tuple[str, str, int]]:
    """(module imported from, name, line) of every `from X import name` in a file, relative imports resolved."""
    tree = ast.parse(path.read_text())
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            out += [(base, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
    return out


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for base, name, _ in imported_names(path, m):
            target = f"{base}.{name}" if f"{base}.{name}" in mods else base
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != m:
                graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = [stack.pop()]
            while comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_the_project_s_modules():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_module_s_private_name():
    mods = project_modules()
    files = {**{m: p for m, p in mods.items()}, **{f"tests.{p.stem}": p for p in (ROOT / "tests").glob("*.py")},
             **{f"bench.{p.stem}": p for p in (ROOT / "bench").rglob("*.py")}}
    offenders = [f"{path.relative_to(ROOT)}:{line}: from {base} import {name}"
                 for m, path in files.items() for base, name, line in imported_names(path, m)
                 if name.startswith("_") and not name.startswith("__") and base.split(".")[0] in
                 PACKAGES + ("tests", "bench")]
    assert not offenders, "\n".join(offenders)
