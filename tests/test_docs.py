"""The documentation site builds with no warning, and shows what it promises.

One build (the README's docs command, ``sphinx-build -W``, from scratch with ``-E`` into a
temporary folder) executes
every notebook, so a failing cell — a notebook's own ``assert`` included — fails it, like a broken
cross-reference or a docstring Sphinx cannot parse. The checks then read the built pages: every
notebook page carries its figures, every public name has its API entry.
"""

import ast
import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jax_sdpa

ROOT = Path(__file__).resolve().parent.parent

# End to end (-m "not slow" leaves it out); one worker runs the whole file, sharing its fixtures.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("docs")]
NOTEBOOKS = sorted(path.stem for path in (ROOT / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    html = tmp_path_factory.mktemp("docs") / "html"
    command = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-b", "html"]
    result = subprocess.run(
        [*command, str(ROOT / "docs"), str(html)], capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return html


def test_the_seven_notebooks_are_there():
    assert NOTEBOOKS == [
        "01_the_four_steps",
        "02_why_sqrt_dk",
        "03_masks",
        "04_jit_and_vmap",
        "05_your_own_attention",
        "06_decoding_with_a_kv_cache",
        "07_beyond_softmax",
    ]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_notebook_page_shows_its_figures(site, name):
    page = (site / "notebooks" / f"{name}.html").read_text()
    images = re.findall(r'<img[^>]+src="\.\./(_images/[^"]+\.(?:png|gif))"', page)
    assert images, f"{name}: no figure on the page"
    assert all((site / image).stat().st_size > 1000 for image in images)


def _defined_publicly(module) -> set[str]:
    """The public names a module's own source defines (functions, classes, assignments)."""
    tree = ast.parse(inspect.getsource(module))
    names = {node.name for node in tree.body if isinstance(node, DEFINITIONS)}
    names |= {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return {name for name in names if not name.startswith("_")}


DEFINITIONS = (ast.FunctionDef, ast.ClassDef)
PUBLIC_MODULES = [
    importlib.import_module(info.name)
    for info in pkgutil.iter_modules(jax_sdpa.__path__, "jax_sdpa.")
    if not info.name.split(".")[-1].startswith("_")
]


def test_all_lists_every_public_name():
    exported = {name for name in vars(jax_sdpa) if not name.startswith("_")}
    assert exported - {module.__name__.split(".")[-1] for module in PUBLIC_MODULES} == (
        set(jax_sdpa.__all__) - {"mods"}
    )
    for module in PUBLIC_MODULES:
        assert _defined_publicly(module) - {"__all__"} <= set(module.__all__), module.__name__


def test_every_public_name_has_an_api_entry(site):
    page = (site / "api.html").read_text()
    names = [f"jax_sdpa.{name}" for name in jax_sdpa.__all__ if name != "mods"]
    names += [f"{module.__name__}.{name}" for module in PUBLIC_MODULES for name in module.__all__]
    missing = [name for name in names if f'id="{name}"' not in page]
    assert not missing, f"no API entry for {missing}"


def test_the_weighted_sum_animation_is_on_the_first_notebook_page(site):
    page = (site / "notebooks" / "01_the_four_steps.html").read_text()
    gifs = re.findall(r'<img[^>]+src="\.\./(_images/[^"]+\.gif)"', page)
    assert gifs and (site / gifs[0]).read_bytes()[:6] in (b"GIF87a", b"GIF89a")


def test_the_landing_page_has_the_quick_start_and_the_formula(site):
    page = (site / "index.html").read_text()
    text = re.sub(r"<[^>]+>", "", page)
    assert "pip install" in text and "python -m jax_sdpa.demo" in text
    assert "softmax_weights(scores, mask)" in text and "(T, S) → (T, S)" in text
    assert 'href="api.html"' in page and 'href="design.html"' in page


def test_the_guides_are_pages_of_the_site_and_the_readme_links_them(site):
    readme = (ROOT / "README.md").read_text()
    guides = sorted(path.stem for path in (ROOT / "docs" / "guides").glob("*.md"))
    assert guides
    for guide in guides:
        assert f"](docs/guides/{guide}.md)" in readme, guide
        assert (site / "guides" / f"{guide}.html").exists(), guide
    drop_in = re.sub(r"<[^>]+>", "", (site / "guides" / "drop_in.html").read_text())
    assert "Complex inputs are refused" in drop_in  # the README's differences, included


def test_the_readme_is_a_front_door():
    # A newcomer's five minutes: at most 200 lines, the example on the first screen.
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200
    assert any("import jax, jax_sdpa" in line for line in lines[:40])
