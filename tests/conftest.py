import atexit
import os
import runpy
import shutil
import sys
import tempfile
from importlib.metadata import version

# XLA's CPU compiler set for the tests (and the processes they start) to compile fast, since
# compiling is most of the suite's time: its LLVM backend at -O0 and one codegen thread (one
# worker per core already), which leave the optimized HLO byte for byte XLA's default, and the
# loop emitters in place of the fusion emitters, which change how some loop fusions are wrapped,
# not what they compute. tests/test_decode.py compiles in 7 s instead of 25 s at -O0 alone;
# running is slower, which the tests' small shapes do not feel. tests/test_generate.py runs the
# generation example with XLA's own settings. A flag given in XLA_FLAGS wins.
FAST_COMPILE = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_parallel_codegen_split_count": "1",
}
# (jaxlib 0.11's XLA has only the fusion emitters, and stops at the flag as unknown)
NEW_JAXLIB = tuple(int(part) for part in version("jaxlib").split(".")[:2]) >= (0, 11)
if not NEW_JAXLIB:
    FAST_COMPILE["xla_cpu_use_fusion_emitters"] = "false"
# Where the GPU simulator's tests run (JAX 0.11 and later), each computation runs in its
# caller's thread: see the async dispatch below. (Not before: the rest of the suite need not
# run on one Eigen thread.)
if NEW_JAXLIB:
    FAST_COMPILE["xla_cpu_multi_thread_eigen"] = "false"
# JAX's GPU simulator runs each warpgroup (and a warpgroup's warps) in a thread of its own, which
# blocks, inside a host callback, until the threads it waits for run: where those run on XLA:CPU's
# pool of one thread per core, two blocked callbacks took a 2-core machine's whole pool and the
# simulation deadlocked (CI's newest-JAX pass hung so, in a quantized decoding test). A pool of 16
# threads (PJRT_NPROC, read when the CPU client is made) leaves room for every level's callbacks.
if NEW_JAXLIB:
    os.environ.setdefault("PJRT_NPROC", "16")
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [_flags, *(f"--{name}={value}" for name, value in FAST_COMPILE.items() if name not in _flags)]
).strip()

# One compilation cache on disk for a run's processes (xdist's workers, the processes the tests
# start, which inherit it): a program one of them compiled, the others read back, however small
# (SPMD processes compile the same programs; behaviour files took 5 to 7 % less time, the demo,
# multihost and generation tests 8 %). Made by the first process, removed as it ends (an entry
# read as another process writes it is compiled again: pyproject.toml's filterwarnings).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_sdpa_tests_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)

# The inner loop, `-m "not slow"`, draws the quick profile's random examples unless a profile is
# named (tests/profile.py); the workers pytest-xdist starts inherit the choice.
if "not slow" in " ".join(sys.argv):
    os.environ.setdefault("JAX_SDPA_PROFILE", "quick")

# The garbage collector's thresholds, here and in every Python process the tests start.
PROCESSES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "processes")
_paths = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
os.environ["PYTHONPATH"] = os.pathsep.join([PROCESSES, *(p for p in _paths if p != PROCESSES)])
runpy.run_path(os.path.join(PROCESSES, "sitecustomize.py"))

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests.profile import X64  # noqa: E402

# tests/multidevice needs 8 simulated devices, set up before JAX starts: tests/test_ring.py runs
# it in a subprocess with JAX_SDPA_MULTIDEVICE=1.
collect_ignore = [] if os.environ.get("JAX_SDPA_MULTIDEVICE") else ["multidevice"]

jax.config.update("jax_enable_x64", X64)  # JAX_SDPA_X64=1 (tests/profile.py)
# Under JAX 0.11 and later each computation on the CPU runs in the thread that calls it (set
# before the CPU client is made), not in XLA's pool of one thread per core: JAX's GPU simulator
# runs each warpgroup's computation from its own thread, and a warpgroup blocked at a barrier
# in a pool thread could hold a 2-core machine's pool while the warpgroup that would release it
# waited for a thread (tests/test_mosaic_gpu.py hung in about 1 run in 5; a loop of its calls
# beside a busy core hung in its third round, and passed eight rounds with both settings).
jax.config.update("jax_cpu_enable_async_dispatch", not NEW_JAXLIB)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def rng():
    """A NumPy generator with a fixed seed: inputs are reproducible, test by test."""
    return np.random.default_rng(0)


# One worker per core, handed tests in this order (a file whose fixtures are shared goes whole to
# one worker, its xdist_group): the longest first.
LONGEST = ("test_ring.py", "test_docs.py", "test_multihost.py")


def pytest_addoption(parser):
    parser.addoption(
        "--each-choice",
        action="store_true",
        help="of a parametrized test, only the cases that take a value of a parameter no case "
        "before took: each value once, not every combination (CI's x64 pass)",
    )


@pytest.hookimpl(trylast=True)  # (after -m and -k have deselected)
def pytest_collection_modifyitems(config, items):
    """The end-to-end tests first, the longest of them first (the rest in their own order);
    under ``--each-choice``, of each parametrized test the cases that bring a new value."""
    if config.getoption("each_choice"):
        taken, kept, left = set(), [], []
        for item in items:
            spec = getattr(item, "callspec", None)
            values = {
                (item.originalname, item.path, name, repr(value))
                for name, value in (spec.params.items() if spec else [])
            }
            (kept if spec is None or values - taken else left).append(item)
            taken |= values
        items[:] = kept
        config.hook.pytest_deselected(items=left)

    def rank(item):
        name = item.path.name
        return (
            LONGEST.index(name)
            if name in LONGEST
            else len(LONGEST) + (not item.get_closest_marker("slow"))
        )

    items.sort(key=rank)


def pytest_runtest_setup(item):
    """A grouped test fails under ``--dist loadgroup`` if its group did not take (each worker would
    then build the docs site and launch the processes of its own): xdist tags a grouped test's id
    with ``@group``, which some pytest releases silently ignore (pytest-dev/pytest-xdist#1386)."""
    grouped = item.get_closest_marker("xdist_group") is not None
    if grouped and item.config.getoption("loadgroup", False) and "@" not in item.nodeid:
        pytest.fail(
            f"--dist loadgroup did not group {item.nodeid}: pytest-xdist cannot tag this "
            "pytest's node ids; install the pytest that pyproject.toml names."
        )
