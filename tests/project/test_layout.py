"""The walls between fusedpar's modules, read off the source (the AST of every file in
fusedpar/ and kernels/, which installs as fusedpar.kernels): no private name imported
across a boundary, no import inside a function to dodge a cycle, no import cycle at all,
``import fusedpar`` leaves the test harness unloaded, and every module docstring of
fusedpar/ and kernels/ says what its module is for in a few lines.

A boundary: kernels/ is one package; fusedpar/ops, nn, plan, integrations and testing
are each one; every top-level fusedpar/*.py module is its own. What a module shares
across one has a public name where it lives."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("kernels", "ops", "nn", "plan", "integrations", "testing")

# Imports inside a function, each for laziness (a heavy optional dependency), not a cycle.
LAZY = {
    # hf.Trainer: Hugging Face's Trainer takes a second to import and needs accelerate
    ("fusedpar.integrations.hf", "fusedpar.integrations.hf_trainer"),
}


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":
        parts = ["fusedpar", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {
    _module_of(p): p
    for folder in ("fusedpar", "kernels")
    for p in sorted((ROOT / folder).rglob("*.py"))
}


def _boundary(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1] in SUBPACKAGES else module


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _imports(module: str):
    """(node, where, [(the module imported from, the name, the local alias)], the tree)
    for each of `module`'s imports of fusedpar, `where` "function", "typing" (under ``if
    TYPE_CHECKING``) or "top"; a name that is a module comes as that module, name None."""
    path = FILES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    inside = set()  # in a function, or for the type checker alone
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    typing = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        found = []
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fusedpar":
                    found.append((a.name, None, a.asname or a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] != "fusedpar":
                continue
            for a in node.names:
                sub = f"{source}.{a.name}"
                found.append(
                    (sub, None, a.asname or a.name)
                    if sub in FILES
                    else (source, a.name, a.asname or a.name)
                )
        if found:
            where = "function" if id(node) in inside else "typing" if id(node) in typing else "top"
            yield node, where, found, tree


def _where(module: str, node) -> str:
    return f"{FILES[module].relative_to(ROOT)}:{node.lineno}"


def test_no_private_name_crosses_a_boundary():
    bad = []
    for module in FILES:
        aliases = {}  # local name -> a module of another boundary
        tree = None
        for node, _, found, tree in _imports(module):  # noqa: B007 (the tree, read below)
            for source, name, alias in found:
                if _boundary(source) == _boundary(module):
                    continue
                # the module path past the shared root: a private module is not imported
                owner = _boundary(source).split(".")
                private_path = any(_private(p) for p in source.split(".")[len(owner) :])
                if name is None and private_path:
                    bad.append(f"{_where(module, node)}: the private module {source}")
                elif private_path:
                    bad.append(f"{_where(module, node)}: {name} from the private module {source}")
                elif name is not None and _private(name):
                    bad.append(f"{_where(module, node)}: {source}.{name}")
                if name is None:
                    aliases[alias] = source
        for node in ast.walk(tree) if tree is not None else ():
            if (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
            ):
                bad.append(f"{_where(module, node)}: {aliases[node.value.id]}.{node.attr}")
    assert not bad, "private names used across a module boundary:\n" + "\n".join(sorted(set(bad)))


def test_no_import_inside_a_function_but_lazy_ones():
    bad = [
        f"{_where(module, node)}: {source}"
        for module in FILES
        for node, where, found, _ in _imports(module)
        if where == "function"
        for source, _, _ in found
        if (module, source) not in LAZY
    ]
    assert not bad, "imports of fusedpar inside functions (a cycle dodged?):\n" + "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    """module -> the modules it imports at its top level (a package's submodule where
    the name is one, else the module named)."""
    graph = {m: set() for m in FILES}
    for module in FILES:
        for _, where, found, _ in _imports(module):
            if where == "top":
                graph[module].update(
                    source for source, _, _ in found if source in FILES and source != module
                )
    return graph


def test_no_import_cycle_between_modules():
    """Between modules, packages' __init__ aside (a package imports its modules, which
    import their siblings through the package's name)."""
    packages = {m for m, p in FILES.items() if p.name == "__init__.py"}
    graph = {
        m: {t for t in ts if t not in packages} for m, ts in _graph().items() if m not in packages
    }
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join([*path[path.index(t) :], t]))
            elif t not in state:
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_axes_are_a_leaf_and_the_pipeline_knows_no_integration():
    graph = _graph()
    assert graph["fusedpar.axes"] <= {"fusedpar.comm"}, graph["fusedpar.axes"]
    everything = {
        source for _, _, found, _ in _imports("fusedpar.pipeline") for source, _, _ in found
    }
    assert not [s for s in everything if s.startswith("fusedpar.integrations")], everything


def test_import_fusedpar_leaves_the_harness_unloaded():
    code = (
        "import fusedpar, sys; assert 'fusedpar.testing' not in sys.modules; fusedpar.testing.World"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


# A module docstring says what the module is for, its entry points and shapes; its history
# and the longer story belong in docs/ and commit messages.
DOCSTRING_LINES = 20


def test_module_docstrings_are_short():
    long = {}
    for path in FILES.values():
        where = path.relative_to(ROOT).as_posix()
        doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
        if doc is not None and len(doc.splitlines()) > DOCSTRING_LINES:
            long[where] = len(doc.splitlines())
    assert not long, f"module docstrings over {DOCSTRING_LINES} lines: {long}"


# Functions with more than this many parameters (self aside; Triton kernels aside, whose
# argument lists are pointers, strides and sizes). The entries users call with keywords,
# and only they, may pass it, and no more than MAX_LONG_SIGNATURES of them: a concept that
# crosses layers travels as one value (AttentionMask, Placement, a spec).
MAX_PARAMETERS = 10
MAX_LONG_SIGNATURES = 16  # 16th: gated_delta_rule, FLA's ten and the CP pair (#56)
KEYWORD_ENTRIES = {
    "fusedpar.nn.attention": {"__init__", "from_dense"},
    "fusedpar.nn.mla": {"__init__"},
    "fusedpar.nn.moe": {"__init__"},
    "fusedpar.nn.linear": {"__init__"},
    "fusedpar.ops.attention": {"flash_attn_varlen"},
    "fusedpar.ops.linear_attention": {"gated_delta_rule"},
    "fusedpar.ops.ring_attention": {"ring_attn"},
    "fusedpar.ops.ulysses": {"ulysses_attn"},
    "fusedpar.ops.virtual_ring": {"virtual_ring_attn"},
    "fusedpar.ops.mla_ring": {"forward"},  # an autograd.Function's, one per saved input
    "fusedpar.ops.linear": {"all_gather_matmul"},
    "fusedpar.plan.estimate": {"estimate"},
    "fusedpar.plan.search": {"search"},
    "fusedpar.pipeline": {"split"},
}


def _is_triton_kernel(node) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_long_signatures_are_few_and_only_users_entries():
    long = []
    for module, path in FILES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
            count = len([n for n in names if n not in ("self", "cls")])
            if count > MAX_PARAMETERS and not _is_triton_kernel(node):
                long.append((module, node.name, count, f"{path.relative_to(ROOT)}:{node.lineno}"))
    stray = [row for row in long if row[1] not in KEYWORD_ENTRIES.get(row[0], ())]
    assert not stray, f"over {MAX_PARAMETERS} parameters, not a user's entry: {stray}"
    assert len(long) <= MAX_LONG_SIGNATURES, f"{len(long)} long signatures: {long}"


def test_no_test_module_imports_another():
    """Shared test code lives in tests/support/ or a family's helpers.py and cases.py."""
    bad = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n.rpartition(".")[2].startswith("test_") for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"test modules importing test modules: {bad}"
