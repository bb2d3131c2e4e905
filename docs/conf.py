"""Sphinx configuration: the notebooks executed and rendered, the API from the docstrings.

Build with ``sphinx-build -W -b html docs docs/_build/html`` (the README's docs command).
"""

import os
import sys
from pathlib import Path

# The pages document, and the notebooks run, this checkout's jax_sdpa (not another installed one).
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import jax_sdpa  # noqa: E402

project = "jax_sdpa"
author = "the jax_sdpa authors"
copyright = "2026, the jax_sdpa authors"  # noqa: A001 (Sphinx's own setting name)
release = jax_sdpa.__version__

extensions = [
    "myst_nb",  # Markdown pages and executed notebooks, as jax and flax build theirs
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # Google-style Args/Returns/Raises
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

# Notebooks run at build time; a failing cell fails the build. Results are cached by content
# (jupyter-cache, next to the build), so a rebuild without changes executes nothing.
nb_execution_mode = "cache"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3

autodoc_default_options = {"members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Every reference must resolve: a broken cross-reference is an error under -W.
nitpicky = True
nitpick_ignore_regex = [
    # Types from other packages, named in signatures (there is no network for intersphinx).
    ("py:class", r"(jax|jaxtyping|numpy|np|jnp|flax|optax|collections|typing)\..*"),
    ("py:class", r"(Array|ArrayLike|Float|Bool|Int|Key|DTypeLike|PRNGKeyArray|Mesh|Callable)"),
    ("py:class", r"(jaxlib\..*|ndarray)"),
    # The keyword groups of the overloads (**keywords: Unpack[Keywords]); the Args list each.
    ("py:class", r"(Keywords|RingKeywords|WeightsKeywords|PagedKeywords|Unpack)"),
    # jaxtyping's shape strings, e.g. Float[Array, 'q_seq kv_seq'], read as class names.
    ("py:class", r".*['\s].*|"),
]

exclude_patterns = ["_build", "**.ipynb_checkpoints"]
html_theme = "sphinx_book_theme"
html_title = "jax_sdpa"
html_theme_options = {
    "show_toc_level": 2,
}

# Math is rendered by MathJax, from a CDN by default. To read the pages offline, point
# JAX_SDPA_MATHJAX at a local MathJax 2 (Debian's libjs-mathjax: /usr/share/javascript/mathjax);
# it is copied into _static/.
if _local_mathjax := os.environ.get("JAX_SDPA_MATHJAX"):
    html_static_path = [_local_mathjax]
    mathjax_path = "MathJax.js?config=TeX-AMS-MML_HTMLorMML"
    mathjax2_config = {  # MathJax 2 reads only what Sphinx and MyST mark as math
        "tex2jax": {
            "processClass": "tex2jax_process|mathjax_process|math|output_area",
            "ignoreClass": "tex2jax_ignore|mathjax_ignore|document",
        }
    }
