"""The package's structure, read from its source with ``ast`` (nothing is imported):

(a) the module import graph has no cycle;
(b) no module uses another module's private names;
(c) only ``gradpress.comm`` (the package) issues ``torch.distributed`` collectives;
(d) imports point down the layers (``LAYERS``), and the engine (``gradpress.powersgd``) imports neither
    ``torch.distributed`` nor ``gradpress.comm``: it defines the protocols it consumes.

Every ``import`` counts, module level or inside a function (a lazy import hides a cycle from the
interpreter, not from the design), ``if TYPE_CHECKING:`` blocks included.

Rules, as checked here:

* **Edges.** ``from .x import y`` is an edge to ``x``, or to ``x.y`` when ``y`` is a submodule;
  ``from . import y`` is an edge to ``y`` when it is a submodule, else to the package. Importing
  ``a.b.c`` also runs ``a`` and ``a.b``: those implicit edges are not counted. A package's
  ``__init__`` importing its own descendants (to re-export them) is not counted either: Python runs the
  package before its children anyway, and counting it would turn every child that imports a sibling
  through the package into a "cycle". A child importing a name from its own package's ``__init__``
  does count, and fails if that package re-exports something that imports the child back.
* **Private names.** A name (or a module in a dotted path) starting with one underscore (dunders
  excluded) belongs to the package it is defined in: a module may use ``_x`` of a *private module* of
  its own package or of a package above it (e.g. ``hooks/_zero_internals.py`` serves ``hooks/``), and
  anything of its own module, but never ``_x`` of another public module (``from .averaging import
  _check_int``), a private module of another package, or ``module._x`` through a module object.
* **Collectives.** Any reference to ``torch.distributed.<collective>`` (called or not, also through
  ``getattr(dist, "<collective>")``) outside ``gradpress.comm``.

``KNOWN_*`` below list what still breaks a rule, one reason each; an entry that no longer breaks it
fails the test, so that the list only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "gradpress"

COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_gather_object", "all_gather_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "send_object_list",
    "recv_object_list", "batch_isend_irecv", "all_to_all", "all_to_all_single",
})

# Modules owned by work in progress elsewhere; each entry says why it is here. Empty them as they go.
KNOWN_COLLECTIVE_CALLERS: dict[str, str] = {}
KNOWN_PRIVATE_USES: dict[tuple[str, str], str] = {}
KNOWN_CYCLES: dict[frozenset[str], str] = {}


# -- reading the package ------------------------------------------------------------------------------

def module_files(root: Path = SRC) -> dict[str, Path]:
    """``{"gradpress.hooks.zero": path, "gradpress.hooks": .../hooks/__init__.py, ...}``."""
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package_of(module: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to (a package's ``__init__`` belongs to the package itself)."""
    return module if modules[module].name == "__init__.py" else module.rpartition(".")[0]


def _resolve(module: str, node: ast.ImportFrom, modules: dict[str, Path]) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module, modules).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class ModuleInfo:
    """What one module imports and references, as far as the rules need."""

    def __init__(self, name: str, tree: ast.AST, modules: dict[str, Path]) -> None:
        self.name = name
        self.imports: set[str] = set()                  # gradpress modules (edges)
        self.private: list[str] = []                    # rule (b) breaches, described
        self.collectives: list[str] = []                # rule (c) breaches, described
        self.imports_dist = False                       # imports torch.distributed (or a submodule)
        package = _package_of(name, modules)
        root = name.split(".")[0]
        module_aliases: dict[str, str] = {}             # local name -> gradpress module it is bound to
        dist_aliases: set[str] = set()                  # local names bound to torch.distributed
        torch_aliases: set[str] = set()                 # local names bound to torch

        def private_ok(owner: str) -> bool:
            """May this module use a private member of module ``owner``?"""
            if owner == name:
                return True
            last = owner.rpartition(".")[2]
            owner_package = owner.rpartition(".")[0]
            return _is_private(last) and (package == owner_package or package.startswith(owner_package + "."))

        def check_path(target: str, where: int) -> None:
            parts = target.split(".")
            for i in range(1, len(parts)):
                if _is_private(parts[i]) and not private_ok(".".join(parts[: i + 1])):
                    self.private.append(f"line {where}: imports private module {'.'.join(parts[: i + 1])}")
                    return

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("torch.distributed"):
                        self.imports_dist = True
                    if alias.name == "torch.distributed":
                        (dist_aliases if alias.asname else torch_aliases).add(alias.asname or "torch")
                    elif alias.name == "torch":
                        torch_aliases.add(alias.asname or "torch")
                    elif alias.name.split(".")[0] == root:
                        self.imports.add(self._known(alias.name, modules))
                        check_path(alias.name, node.lineno)
                        module_aliases[alias.asname or root] = alias.name if alias.asname else root
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, node, modules)
                if source.startswith("torch.distributed") or (
                        source == "torch" and any(a.name == "distributed" for a in node.names)):
                    self.imports_dist = True
                if source == "torch":
                    dist_aliases.update(a.asname or a.name for a in node.names if a.name == "distributed")
                    continue
                if source.split(".")[0] != root:
                    continue
                check_path(source, node.lineno)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:
                        self.imports.add(sub)
                        module_aliases[alias.asname or alias.name] = sub
                        check_path(sub, node.lineno)
                    else:
                        self.imports.add(self._known(source, modules))
                        if _is_private(alias.name) and not private_ok(self._known(source, modules)):
                            self.private.append(f"line {node.lineno}: imports {alias.name} from {source}")

        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                owner = self._dotted(node.value, module_aliases, modules)
                if owner is not None and _is_private(node.attr) and not private_ok(owner) \
                        and f"{owner}.{node.attr}" not in modules:
                    self.private.append(f"line {node.lineno}: reads {owner}.{node.attr}")
                if node.attr in COLLECTIVES and self._is_dist(node.value, dist_aliases, torch_aliases):
                    self.collectives.append(f"line {node.lineno}: torch.distributed.{node.attr}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) >= 2 and self._is_dist(node.args[0], dist_aliases, torch_aliases) \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLECTIVES:
                self.collectives.append(f"line {node.lineno}: getattr(torch.distributed, {node.args[1].value!r})")
        self.imports.discard(name)
        if modules[name].name == "__init__.py":  # re-exports of its own children: see the module docstring
            self.imports = {m for m in self.imports if not m.startswith(name + ".")}

    @staticmethod
    def _known(module: str, modules: dict[str, Path]) -> str:
        """``module``, or its nearest enclosing module that exists (``a.b.name`` -> ``a.b``)."""
        while module not in modules and "." in module:
            module = module.rpartition(".")[0]
        return module

    @staticmethod
    def _dotted(node: ast.AST, aliases: dict[str, str], modules: dict[str, Path]) -> str | None:
        """The gradpress module an expression such as ``checkpoint`` or ``gradpress.hooks`` names."""
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = ModuleInfo._dotted(node.value, aliases, modules)
            if owner is not None and f"{owner}.{node.attr}" in modules:
                return f"{owner}.{node.attr}"
        return None

    @staticmethod
    def _is_dist(node: ast.AST, dist_aliases: set[str], torch_aliases: set[str]) -> bool:
        if isinstance(node, ast.Name):
            return node.id in dist_aliases
        return isinstance(node, ast.Attribute) and node.attr == "distributed" \
            and isinstance(node.value, ast.Name) and node.value.id in torch_aliases


def read_package(sources: dict[str, str] | None = None) -> dict[str, ModuleInfo]:
    """Every module of the package (or of ``sources``: ``{module name: code}``, for the tests of the
    checker itself; a name ending in ``.__init__`` is a package)."""
    if sources is None:
        files = module_files()
        texts = {m: p.read_text(encoding="utf-8") for m, p in files.items()}
    else:
        files = {m.removesuffix(".__init__"): Path(f"{m.replace('.', '/')}.py") for m in sources}
        texts = {m.removesuffix(".__init__"): code for m, code in sources.items()}
    return {m: ModuleInfo(m, ast.parse(code, str(files[m])), files) for m, code in texts.items()}


def cycles(infos: dict[str, ModuleInfo]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(infos[v].imports):
            if w not in infos:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(infos):
        if v not in index:
            visit(v)
    return found


def _describe(items: Iterable[str]) -> str:
    return "\n  ".join(sorted(items))


# -- the rules -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def package() -> dict[str, ModuleInfo]:
    infos = read_package()
    assert "gradpress.comm" in infos and len(infos) > 30
    return infos


def test_import_graph_has_no_cycle(package):
    found = set(cycles(package))
    new = found - set(KNOWN_CYCLES)
    assert not new, "import cycles:\n  " + _describe(" <-> ".join(sorted(c)) for c in new)
    stale = set(KNOWN_CYCLES) - found
    assert not stale, f"no longer cycles, remove from KNOWN_CYCLES: {stale}"


def test_no_module_uses_another_modules_private_names(package):
    found = {(m, use) for m, info in package.items() for use in info.private}
    new = {(m, use) for m, use in found if (m, use.partition(": ")[2]) not in KNOWN_PRIVATE_USES}
    assert not new, "private names used across modules:\n  " + _describe(f"{m} {use}" for m, use in new)
    stale = set(KNOWN_PRIVATE_USES) - {(m, use.partition(": ")[2]) for m, use in found}
    assert not stale, f"no longer used, remove from KNOWN_PRIVATE_USES: {stale}"


def _in_comm(module: str) -> bool:
    return module == "gradpress.comm" or module.startswith("gradpress.comm.")


def test_only_comm_issues_collectives(package):
    callers = {m: info.collectives for m, info in package.items() if info.collectives and not _in_comm(m)}
    new = {m: c for m, c in callers.items() if m not in KNOWN_COLLECTIVE_CALLERS}
    assert not new, "collectives outside gradpress.comm:\n  " + _describe(f"{m} {c}" for m, c in new.items())
    stale = set(KNOWN_COLLECTIVE_CALLERS) - set(callers)
    assert not stale, f"no longer issue collectives, remove from KNOWN_COLLECTIVE_CALLERS: {stale}"
    assert any(info.collectives for m, info in package.items() if _in_comm(m))  # the checker sees comm's own


def test_averaging_and_aggregator_depend_one_way(package):
    averaging = {m for m in package if m == "gradpress.averaging" or m.startswith("gradpress.averaging.")}
    assert not package["gradpress.aggregator"].imports & averaging
    for module in filter(_in_comm, package):  # comm sits at the bottom
        assert all(_in_comm(m) for m in package[module].imports), (module, package[module].imports)


#: The layers, lowest first: a module may import its own layer and those below, never one above. The
#: package root (the public API's lazy export table) and ``__main__`` share the tools' layer: the tools
#: are the public API's users. Module names are prefixes
#: (``gradpress.hooks`` covers ``gradpress.hooks.zero``).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("gradpress.comm",),                                          # every torch.distributed collective
    ("gradpress.powersgd",),                                      # the engine and the protocols it consumes
    ("gradpress.validation", "gradpress.diagnostics", "gradpress.policy", "gradpress.adaptive", "gradpress.autorank",
     "gradpress.checkpoint", "gradpress.launch"),                 # features the front ends share
    ("gradpress.hooks", "gradpress.aggregator"),                  # the front ends over the engine
    ("gradpress.averaging",),                                     # local SGD, DiLoCo's outer step
    ("gradpress.streaming",),                                     # streaming DiLoCo
    ("gradpress.integrations",),                                  # Lightning, Accelerate, Trainer
    ("gradpress.tools",),                                         # cli, check, bench, workloads, zoo
)
TOP = frozenset({"gradpress", "gradpress.__main__"})


def layer_of(module: str) -> int:
    """The index of ``module``'s layer in :data:`LAYERS` (the root and ``__main__``: the tools')."""
    if module in TOP:
        return len(LAYERS) - 1
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/package/test_structure.py")


def upward_imports(infos: dict[str, ModuleInfo]) -> list[str]:
    return sorted(f"{m} (layer {layer_of(m)}) imports {target} (layer {layer_of(target)})"
                  for m, info in infos.items() for target in info.imports
                  if target in infos and layer_of(target) > layer_of(m))


def test_imports_point_down_the_layers(package):
    assert not upward_imports(package), "imports up the layers:\n  " + _describe(upward_imports(package))
    hooks, aggregator = ("gradpress.hooks", "gradpress.aggregator")
    for module, info in package.items():  # the two front ends are peers: neither imports the other
        if module == aggregator:
            assert not {m for m in info.imports if m == hooks or m.startswith(hooks + ".")}, info.imports
        if module.startswith(hooks + "."):
            assert aggregator not in info.imports, (module, info.imports)


def test_the_engine_never_imports_torch_distributed_or_comm(package):
    engine = {m: info for m, info in package.items()
              if m == "gradpress.powersgd" or m.startswith("gradpress.powersgd.")}
    assert len(engine) >= 8
    assert not [m for m, info in engine.items() if info.imports_dist], "the engine imports torch.distributed"
    assert not [(m, info.imports) for m, info in engine.items() if any(_in_comm(t) for t in info.imports)]


MAX_LINES = 500
#: The engine's modules hold one role each (schedules, kernels, backend, wire, commit, probe, layout,
#: memory, ...): a few hundred lines at most.
MAX_ENGINE_LINES = 450


def test_no_module_is_longer_than_500_lines_and_no_engine_module_longer_than_450():
    lengths = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in module_files().items()}
    long = {m: n for m, n in lengths.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"
    engine = {m: n for m, n in lengths.items() if m.startswith("gradpress.powersgd.") and n > MAX_ENGINE_LINES}
    assert not engine, f"engine modules over {MAX_ENGINE_LINES} lines (one role each): {engine}"


def test_only_the_backend_asks_what_a_device_is():
    """The engine chooses each device-dependent kernel through its backend (:mod:`gradpress.powersgd.backend`):
    no other engine module tests a device's type."""
    offenders = {m: line.strip() for m, p in module_files().items()
                 if m.startswith("gradpress.powersgd.") and m != "gradpress.powersgd.backend"
                 for line in p.read_text(encoding="utf-8").splitlines()
                 if ".type ==" in line or ".type !=" in line or "_reading_waits" in line}
    assert not offenders, f"device tests outside the backend: {offenders}"


# -- the checker itself --------------------------------------------------------------------------------

def test_checker_finds_a_cycle_hidden_in_a_function():
    infos = read_package({
        "pkg.__init__": "from .a import f\n",
        "pkg.a": "from .b import g\ndef f():\n    return g()\n",
        "pkg.b": "def g():\n    from .a import f\n    return f\n",
        "pkg.c": "from . import a\n",
    })
    assert cycles(infos) == [frozenset({"pkg.a", "pkg.b"})]
    assert infos["pkg"].imports == set()          # re-exporting a child is not an edge
    assert infos["pkg.c"].imports == {"pkg.a"}    # `from . import a` is an edge to the module


def test_checker_finds_an_upward_import_and_torch_distributed():
    infos = read_package({
        "gradpress.__init__": "",
        "gradpress.comm.__init__": "",
        "gradpress.comm.x": "from ..hooks import h\n",
        "gradpress.hooks.__init__": "",
        "gradpress.hooks.h": "from torch import distributed\nh = 1\n",
        "gradpress.powersgd.__init__": "",
        "gradpress.powersgd.s": "import torch.distributed.distributed_c10d\n",
    })
    assert upward_imports(infos) == ["gradpress.comm.x (layer 0) imports gradpress.hooks.h (layer 3)"]
    assert infos["gradpress.hooks.h"].imports_dist and infos["gradpress.powersgd.s"].imports_dist
    assert not infos["gradpress.comm.x"].imports_dist


def test_checker_finds_private_uses_and_collectives():
    infos = read_package({
        "pkg.__init__": "",
        "pkg.a": "_x = 1\n",
        "pkg.sub.__init__": "",
        "pkg.sub._internal": "def helper(): pass\n",
        "pkg.sub.user": "from ._internal import helper\nfrom ..a import _x\n",
        "pkg.b": "from . import a\nimport torch\nimport torch.distributed as dist\nfrom .sub._internal import helper\n"
                 "y = a._x\ndist.all_reduce(t)\ntorch.distributed.barrier()\ngetattr(dist, 'all_gather_single')\n"
                 "dist.get_rank()\n",
    })
    assert [u.partition(": ")[2] for u in infos["pkg.sub.user"].private] == ["imports _x from pkg.a"]
    assert {u.partition(": ")[2] for u in infos["pkg.b"].private} == {
        "imports private module pkg.sub._internal", "reads pkg.a._x"}
    assert {c.partition(": ")[2] for c in infos["pkg.b"].collectives} == {
        "torch.distributed.all_reduce", "torch.distributed.barrier",
        "getattr(torch.distributed, 'all_gather_single')"}
