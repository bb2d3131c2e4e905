"""Every ``>>>`` example in the package runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import jax_sdpa

# The examples show what a default session prints (x64 off): not in the x64 pass (.ci/run).
pytestmark = pytest.mark.x64_off

# Subpackages too (the demo's parts are modules of jax_sdpa.demo).
MODULES = sorted(m.name for m in pkgutil.walk_packages(jax_sdpa.__path__, "jax_sdpa."))


@pytest.mark.parametrize("name", MODULES)
def test_examples_in_docstrings(name):
    results = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert results.failed == 0
