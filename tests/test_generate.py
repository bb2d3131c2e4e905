"""The generation example's short run: both caches, every step checked against the full forward."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "generate.py"

pytestmark = pytest.mark.slow  # end to end: -m "not slow" leaves it out


def test_generation_with_contiguous_and_paged_caches_matches_the_full_forward():
    # The script asserts each step's logits against the whole sequence run from scratch, and
    # that both caches generate the same tokens; it fails (non-zero exit) otherwise.
    run = subprocess.run(
        [sys.executable, str(EXAMPLE), "--short"], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for cache in ("contiguous", "paged"):
        line = next(line for line in lines if line.startswith(cache))
        assert "tokens/s (each step checked against the full forward)" in line
