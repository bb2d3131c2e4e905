"""Ring attention across real processes: 2 JAX processes x 4 CPU devices on this machine.

The example's launcher (examples/multihost_ring.py) starts them: a free port for the
coordinator, CPU collectives by gloo, each process in a session of its own, and a deadline
after which every one still running is killed with its process group, so nothing here can
hang. One launch runs all the numerical checks (tests/multihost/checks.py) and reports each
one's numbers, which the tests below assert: the oracle is single-device
``dot_product_attention`` with the tolerances of tests/multidevice (forward 1e-6, gradients 1e-5
relative). One more runs the example's short mode, one more checks a process's own deadline,
three more kill a process mid-run.
"""

import importlib.util
import inspect
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import pytest

# End to end (-m "not slow" leaves it out); one worker runs the whole file, sharing its fixtures.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("multihost")]

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "multihost"
EXAMPLE = ROOT / "examples" / "multihost_ring.py"
_spec = importlib.util.spec_from_file_location("multihost_ring", EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def launch(script, *args, timeout):
    return example.launch([sys.executable, str(WORKERS / script), *args], 2, timeout=timeout)


def why(runs):
    return "\n".join(
        f"process {i}: exit {run.returncode}{' (killed at the deadline)' * run.timed_out}\n"
        f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
        for i, run in enumerate(runs)
    )


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost")
    runs = launch("checks.py", f"--out={out}", timeout=300)
    assert all(run.returncode == 0 for run in runs), why(runs)
    return [json.loads((out / f"process-{i}.json").read_text()) for i in range(len(runs))]


def each_process(checks, name):
    for result in checks:
        assert "error" not in result[name], result[name].get("error")
    return [result[name] for result in checks]


# Name: whether the program also sums gradients over devices (closed-over slopes and sinks).
RING_CHECKS = {
    "ring_dot_product_attention striped causal, batch over devices, key lengths": False,
    "ring_attention in shard_map, contiguous": False,
    "score_mod, mask_mod and sinks": True,
}


@pytest.mark.parametrize("name", RING_CHECKS)
def test_ring_across_processes_matches_one_device(checks, name):
    for result in each_process(checks, name):
        assert result["forward"] <= 1e-6
        assert max(result["grads"]) <= 1e-5
        # Keys and values pass from device to device; none gathers them (nor the sequence).
        assert result["hlo"]["collective-permute"] > 0
        assert result["hlo"]["all-gather"] == 0
        assert (result["hlo"]["all-reduce"] > 0) == RING_CHECKS[name]


def test_training_across_processes_matches_one_process(checks):
    for result in each_process(checks, "training"):
        assert result["loss_rel"] <= 1e-5
        assert result["params_rel"] <= 1e-5
        assert result["params_moved"] > 1e-3  # every weight changed: the steps did something
        assert all(a > b for a, b in itertools.pairwise(result["losses"]))


@pytest.mark.parametrize(
    "case, argument",
    [
        ("query length", "query"),
        ("key length", "key"),
        ("striped length", "query"),
        ("seq_axis", "seq_axis"),
        ("axis_name", "axis_name"),
        ("outside shard_map", "axis_name"),
    ],
)
def test_a_mismatched_mesh_raises_value_error_naming_the_argument_on_every_process(
    checks, case, argument
):
    for raised in each_process(checks, "mismatched mesh"):
        kind, message = raised[case]
        assert kind == "ValueError"
        assert message.startswith(f"`{argument}` must")
        if case == "outside shard_map":
            assert "runs only inside" in message, message


def test_example_runs_over_two_processes_and_matches_one_process():
    launcher = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--processes=2", "--short", "--timeout=120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = launcher.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGTERM)  # the launcher kills its processes on the way out
        out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, out + err
    lines = [line for line in out.splitlines() if line.startswith("process")]
    assert [line[:11] for line in lines] == ["process 0/2", "process 1/2"], out
    for line in lines:
        assert re.search(r"peak RSS \d+ MiB", line), line
        assert float(line.rsplit("|", 1)[1]) <= 1e-6, line


def test_a_process_ends_itself_at_its_deadline_with_no_launcher_to_kill_it():
    # Process 1 of a job whose coordinator never starts: it waits in jax.distributed.initialize
    # (for up to 60 s) until its own --deadline ends it, as when a CI run kills the launcher.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    deadline = time.time() + 5
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--short", f"--coordinator=127.0.0.1:{port}"]
        + ["--num-processes=2", "--process-id=1", f"--deadline={deadline}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        start_new_session=True,
    )
    try:
        returncode = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert returncode == 124
    assert time.time() - deadline < 5


@pytest.fixture(scope="module")
def deaths():
    # Short heartbeat and shutdown timeouts (JAX's defaults: 100 s and 300 s); the two jobs
    # run side by side.
    timeouts = ["--heartbeat-timeout=5", "--shutdown-timeout=5"]
    with ThreadPoolExecutor(len(DEATHS)) as pool:
        jobs = {
            (death, victim): pool.submit(
                launch, "dies.py", f"--victim={victim}", f"--death={death}", *timeouts, timeout=120
            )
            for death, victim in DEATHS
        }
        return {job: future.result() for job, future in jobs.items()}


# SIGKILL of process 1: the coordination service (in process 0) misses its heartbeats. SIGKILL
# of process 0: the service itself dies with it. An exception in process 0: it waits at the
# shutdown barrier, then tells the others.
DEATHS = [("kill", 1), ("kill", 0), ("raise", 0)]


@pytest.mark.skipif(
    "heartbeat_timeout_seconds" not in inspect.signature(jax.distributed.initialize).parameters,
    reason="JAX before 0.7 has no heartbeat timeout to set: a death is noticed after 100 s",
)
@pytest.mark.parametrize("death, victim", DEATHS)
def test_when_a_process_dies_mid_run_the_other_ends_with_an_error_within_seconds(
    deaths, death, victim
):
    runs = deaths[death, victim]
    died_at = re.search(r"dies at ([0-9.]+)", runs[victim].stdout)
    assert died_at, why(runs)
    # None, the victim included, is left for the launcher to kill at its deadline.
    assert not any(run.timed_out for run in runs), why(runs)
    survivor = runs[1 - victim]
    assert survivor.returncode != 0
    assert "most likely indicates that another task died" in survivor.stderr
    seconds = survivor.ended - float(died_at.group(1))
    print(f"{death} process {victim}: the survivor ended {seconds:.1f} s later")  # pytest -rP
    assert seconds < 30, seconds
