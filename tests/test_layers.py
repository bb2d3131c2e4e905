"""The package's imports follow the layers that ``docs/design.md`` declares (its table of modules)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jax_sdpa"
PEERS = "implementations"  # the one layer whose modules never import each other


def _layers() -> list[tuple[str, list[str]]]:
    """``[(layer, [module, ...]), ...]``, lowest first, from the design's table.

    A module of a subpackage is named with its package: ``_kernels.reads``.
    """
    rows = re.findall(
        r"^\| ([a-z &]+) \| ((?:`[\w.]+` ?)+)\|$", (ROOT / "docs/design.md").read_text(), re.M
    )
    return [(layer, re.findall(r"`([\w.]+)`", modules)) for layer, modules in rows]


LAYERS = _layers()
RANK = {
    module: (layer_rank, position)
    for layer_rank, (_, modules) in enumerate(LAYERS)
    for position, module in enumerate(modules)
}
LAYER_OF = {module: layer for layer, modules in LAYERS for module in modules}


def _module(dotted: str) -> str:
    """A module's name in the table: ``jax_sdpa._kernels.reads`` → ``_kernels.reads``."""
    return dotted.removeprefix("jax_sdpa.")


def _imports(path: Path) -> set[str]:
    """The ``jax_sdpa`` modules (as the table names them) that ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "jax_sdpa" or node.module in SUBPACKAGES:
                prefix = "" if node.module == "jax_sdpa" else _module(node.module) + "."
                found |= {prefix + alias.name for alias in node.names}
            elif node.module.startswith("jax_sdpa."):
                found.add(_module(node.module))
        elif isinstance(node, ast.Import):
            found |= {_module(a.name) for a in node.names if a.name.startswith("jax_sdpa.")}
    return found


SUBPACKAGES = {f"jax_sdpa.{p.parent.name}" for p in PACKAGE.glob("_*/__init__.py")}


def _path(module: str) -> Path:
    path = PACKAGE / (module.replace(".", "/") + ".py")
    return path if path.exists() else PACKAGE / module / "__init__.py"


def test_the_table_names_every_module_of_the_package_once():
    modules = [module for _, names in LAYERS for module in names]
    assert len(modules) == len(set(modules))
    flat = {p.stem for p in PACKAGE.glob("*.py")}
    packaged = {
        p.parent.name if p.stem == "__init__" else f"{p.parent.name}.{p.stem}"
        for p in PACKAGE.glob("_*/*.py")
    }
    assert set(modules) == flat | packaged


@pytest.mark.parametrize("module", sorted(RANK))
def test_a_module_imports_only_what_lies_below_it(module):
    for imported in _imports(_path(module)):
        assert imported in RANK, f"{module} imports {imported}, which no layer of the table holds"
        layer, imported_layer = LAYER_OF[module], LAYER_OF[imported]
        where = f"{module} ({layer}) imports {imported} ({imported_layer})"
        assert RANK[imported] < RANK[module], f"{where}: up the layers, or later in its own"
        assert not (layer == imported_layer == PEERS), f"{where}: implementations are peers"


def test_the_demo_imports_only_the_public_api():
    for path in (PACKAGE / "demo").glob("*.py"):
        private = {m for m in _imports(path) if m != "demo" and m.startswith("_")}
        assert not private, f"demo/{path.name} imports private modules {sorted(private)}"
