"""The generation example's short run: both caches, every step checked against the full forward."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "generate.py"

pytestmark = pytest.mark.slow  # end to end: -m "not slow" leaves it out


def _generated(*flags: str, env=None) -> list[str]:
    """The example's output lines, run with ``--short`` and ``flags``; its exit must be 0."""
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--short", *flags],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def _each_step_checked(lines: list[str]) -> None:
    for cache in ("contiguous", "paged"):
        line = next(line for line in lines if line.startswith(cache))
        assert "tokens/s (each step checked against the full forward)" in line


def test_generation_with_contiguous_and_paged_caches_matches_the_full_forward():
    # The script asserts each step's logits against the whole sequence run from scratch, and
    # that both caches generate the same tokens; it fails (non-zero exit) otherwise. It runs with
    # XLA's own compiler settings, as a user runs it (the rest of the suite compiles for speed of
    # compiling: tests/conftest.py).
    _each_step_checked(_generated(env=dict(os.environ, XLA_FLAGS="")))


def test_generation_with_an_int8_cache_matches_the_full_forward_on_the_same_rounding():
    lines = _generated("--cache", "int8")
    moved = next(line for line in lines if line.startswith("int8 cache"))
    assert float(moved.split("by ")[1].split()[0]) < 2.0**-7  # within the format's step


def test_generation_on_the_fused_kernel_in_bfloat16_with_an_int8_cache_matches_the_full_forward():
    # --kernel interpret: the cached steps' attention on the fused kernel in the Pallas
    # interpreter (packed heads; the paged cache through Paged(kernel=...)), the model and its
    # caches in bfloat16 (as the Mosaic GPU kernel takes them), int8, each step checked.
    flags = ("--kernel", "interpret", "--cache", "int8", "--dtype", "bfloat16")
    _each_step_checked(_generated(*flags))
