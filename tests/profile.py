"""The settings of a test run, from environment variables: x64, and how many random examples.

``JAX_SDPA_X64=1`` runs with ``jax_enable_x64`` on, as many scientific users run JAX: indices
must stay int32 and float32 inputs float32 (CI runs the behaviour tests both ways).

``JAX_SDPA_PROFILE=quick`` is the inner loop, ``ci`` (the default) what CI runs, ``thorough`` a
long local run (JAX's ``JAX_NUM_GENERATED_CASES`` idea). ``JAX_SDPA_SWEEP_CASES=N`` sets the
random sweep's cases per implementation (``tests/sweep.py``), whatever the profile.
"""

import math
import os

# Hypothesis examples per property test; the sweep's structures per implementation and the
# data drawn for each (a structure is compiled once: its draws reuse the program).
PROFILES = {
    "quick": dict(vmapped=2, ranges=8, rows=5, structures=1, draws=2),
    "ci": dict(vmapped=3, ranges=10, rows=8, structures=2, draws=4),
    "thorough": dict(vmapped=100, ranges=1000, rows=500, structures=200, draws=10),
}
X64 = os.environ.get("JAX_SDPA_X64", "0") == "1"
PROFILE = os.environ.get("JAX_SDPA_PROFILE", "ci")
if PROFILE not in PROFILES:
    raise ValueError(f"JAX_SDPA_PROFILE must be one of {', '.join(PROFILES)}; got {PROFILE!r}.")


def examples(name: str) -> int:
    """How many examples the property test ``name`` draws in this profile."""
    return PROFILES[PROFILE][name]


DRAWS = examples("draws")
_cases = os.environ.get("JAX_SDPA_SWEEP_CASES")
STRUCTURES = examples("structures") if _cases is None else math.ceil(int(_cases) / DRAWS)
