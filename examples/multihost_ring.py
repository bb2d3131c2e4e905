"""Ring attention across processes: one long sequence, several JAX processes.

    python examples/multihost_ring.py --processes 2          # 2 processes × 4 CPU devices here
    python examples/multihost_ring.py --processes 2 --short  # the test suite's quick run

``--processes P`` starts P processes of this script on this machine and waits for them (they
talk over 127.0.0.1; XLA simulates each one's CPU devices). On a cluster, run the script once per
host instead: with ``--coordinator HOST:PORT --num-processes P --process-id I`` it joins that
job, and with none of the three, plain ``jax.distributed.initialize()`` reads the cluster's own
settings (SLURM, Open MPI, Kubernetes, Cloud TPU).

Each process makes only its own rows of the sequence (in the striped layout, which evens out
the causal work), assembles them into one global array with
``jax.make_array_from_process_local_data``, and runs ``ring_attention`` in a ``shard_map`` over
every device of every process: keys and values travel round the ring from device to device and
from process to process. Each prints its peak memory (RSS) and the largest difference from
single-process attention: with ``--short``, over every row it holds; in the long run, only over
its rows in the shortest prefix that reaches every process (causal: a prefix needs only its own
keys; the whole sequence is too big for one process).

A process that dies does not leave the others hanging: JAX's coordination service misses its
heartbeats for ``--heartbeat-timeout`` seconds and ends the others with an error, and a process
that stops on an exception waits at most ``--shutdown-timeout`` seconds for the rest. The
launcher kills whatever still runs after ``--timeout`` seconds. (tests/test_multihost.py starts
its own jobs with this file's ``launch``, ``cluster_arguments`` and ``join``.)
"""

import argparse
import contextlib
import dataclasses
import functools
import inspect
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_sdpa


def cluster_arguments() -> argparse.ArgumentParser:
    """The options that start a job here (``--processes``) or join one as one process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, help="start this many local processes")
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds before the launcher kills"
    )
    parser.add_argument("--coordinator", help="HOST:PORT of process 0")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--heartbeat-timeout", type=int, default=10)
    parser.add_argument("--shutdown-timeout", type=int, default=30)
    parser.add_argument(
        "--deadline", type=float, help="time.time() at which this process ends (exit status 124)"
    )
    return parser


def join(args: argparse.Namespace) -> None:
    """Joins the job: one JAX runtime over every process's devices, CPU collectives by gloo."""
    if args.deadline is not None:
        # A process in a session of its own outlives a kill of its starter's process group, so
        # it keeps a deadline of its own (os._exit: it ends even inside a collective).
        timer = threading.Timer(max(0.0, args.deadline - time.time()), os._exit, (124,))
        timer.daemon = True
        timer.start()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = dict(
        heartbeat_timeout_seconds=args.heartbeat_timeout,
        shutdown_timeout_seconds=args.shutdown_timeout,
    )
    # (JAX before 0.7 takes neither: there a dead process is noticed after JAX's own timeouts.)
    taken = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(  # None, None, None: read from the cluster's environment
        args.coordinator,
        args.num_processes,
        args.process_id,
        initialization_timeout=60,
        **{name: seconds for name, seconds in timeouts.items() if name in taken},
    )


# Seconds after the launcher's deadline at which each process ends itself: the launcher kills
# first (and reports it), the process's own deadline is for when the launcher is gone.
_GRACE = 5.0


@dataclasses.dataclass(frozen=True)
class Finished:
    """One local process of a job, once it has ended or been killed at the deadline."""

    returncode: int
    ended: float  # time.time() when it ended or was killed
    timed_out: bool
    stdout: str
    stderr: str


def launch(command: list[str], processes: int, *, devices: int = 4, timeout: float = 300):
    """Runs ``command`` as processes ``0 … P−1`` of one job on this machine; their results.

    Each process gets ``devices`` simulated CPU devices and a session of its own; whatever still
    runs after ``timeout`` seconds (or when the launcher is stopped) is killed with its process
    group, so a job can never hang its caller. Each process also gets ``--deadline``, a few
    seconds later, at which it ends itself: if the launcher is killed outright, none lingers.
    """
    with socket.socket() as free:  # a port for the coordinator that nothing else holds now
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    cluster = [f"--coordinator=127.0.0.1:{port}", f"--num-processes={processes}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = flags.strip()
    deadline, ended, killed = time.time() + timeout, [None] * processes, set()
    cluster.append(f"--deadline={deadline + _GRACE}")
    with contextlib.ExitStack() as files:
        logs = [[files.enter_context(tempfile.TemporaryFile("w+")) for _ in "oe"] for _ in ended]
        running = []
        try:
            for i, (out, err) in enumerate(logs):  # in the try: a failed start kills the started
                running.append(
                    subprocess.Popen(
                        [*command, *cluster, f"--process-id={i}"],
                        stdout=out,
                        stderr=err,
                        env=env,
                        text=True,
                        start_new_session=True,
                    )
                )
            while None in ended and time.time() < deadline:
                time.sleep(0.05)
                for i, proc in enumerate(running):
                    if ended[i] is None and proc.poll() is not None:
                        ended[i] = time.time()
        finally:
            for i, proc in enumerate(running):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed.add(i)
                proc.wait()
                ended[i] = ended[i] or time.time()
        for log in (f for pair in logs for f in pair):
            log.seek(0)
        return [
            Finished(proc.returncode, ended[i], i in killed, out.read(), err.read())
            for i, (proc, (out, err)) in enumerate(zip(running, logs, strict=True))
        ]


def sequence_rows(positions, chunk: int, heads: int, dim: int, salt: int) -> np.ndarray:
    """Rows of one long random sequence at ``positions``, whole chunks of ``chunk``.

    Every process draws the same numbers for the same chunk, and only the chunks it asks for.
    """
    draw = lambda c: np.random.default_rng([salt, c]).standard_normal((chunk, heads, dim))  # noqa: E731
    return np.concatenate([draw(c) for c in positions[::chunk] // chunk], dtype=np.float32)[None]


def attend(seq: int, heads: int, kv_heads: int, dim: int, *, check_all: bool) -> str:
    """Causal ring attention over every process's devices; a line on memory and error.

    ``check_all``: compare every row this process holds with one-process attention over the
    whole sequence; otherwise only its rows in a prefix (the whole is too big for one process).
    """
    devices = jax.devices()  # every process's
    mesh = jax.sharding.Mesh(np.array(devices), ("seq",))
    spec = P(None, "seq", None, None)
    sharding = NamedSharding(mesh, spec)
    # The global arrays are in striped order; this process holds a run of it, its devices' rows.
    striped = np.asarray(jax_sdpa.to_striped(np.arange(seq), len(devices), axis=0))
    chunk = seq // (2 * len(devices))
    spans = [i[1] for i in sharding.addressable_devices_indices_map((1, seq, 1, 1)).values()]
    mine = striped[min(s.start for s in spans) : max(s.stop for s in spans)]
    shapes = {"query": heads, "key": kv_heads, "value": kv_heads}
    arrays = [
        jax.make_array_from_process_local_data(
            sharding, sequence_rows(mine, chunk, n, dim, salt), (1, seq, n, dim)
        )
        for salt, n in enumerate(shapes.values())
    ]
    ring = functools.partial(
        jax_sdpa.ring_attention, axis_name="seq", is_causal=True, layout="striped"
    )
    ring = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    start = time.perf_counter()
    out = ring(*arrays).block_until_ready()
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    line = (
        f"process {jax.process_index()}/{jax.process_count()}: {len(mine)} of {seq} positions "
        f"on {jax.local_device_count()} devices, {seconds:.1f} s (compile included), "
        f"peak RSS {rss:.0f} MiB"
    )
    # Checked on one process: the whole sequence, or the shortest prefix with rows on every
    # process (up to the last process's first chunk); causal, its rows need no key beyond it.
    last = min(
        d for d, device in enumerate(devices) if device.process_index == jax.process_count() - 1
    )
    prefix = seq if check_all else (last + 1) * chunk
    parts = [
        sequence_rows(np.arange(prefix), chunk, n, dim, salt)
        for salt, n in enumerate(shapes.values())
    ]
    single = np.asarray(jax_sdpa.dot_product_attention(*parts, is_causal=True))
    error = 0.0
    for shard in out.addressable_shards:
        positions = striped[shard.index[1]]
        held = positions < prefix
        if held.any():
            diff = np.asarray(shard.data)[:, held] - single[:, positions[held]]
            error = max(error, float(np.abs(diff).max()))
    rows = "all its rows" if check_all else f"its rows in positions 0-{prefix - 1}"
    return line + f"; {rows}: max |ring - one process| {error:.1e}"


def main() -> int:
    """Starts the local processes (``--processes``) or runs as one of them."""
    parser = cluster_arguments()
    parser.add_argument("--short", action="store_true", help="a short sequence, for the tests")
    args = parser.parse_args()
    seq, heads, kv_heads, dim = (4096 if args.short else 32768), 4, 2, 64
    if args.processes:
        # A stopped launcher (SIGTERM) still kills its processes: launch's `finally` runs.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        command = [sys.executable, __file__, *(["--short"] if args.short else [])]
        command += [f"--heartbeat-timeout={args.heartbeat_timeout}"]
        command += [f"--shutdown-timeout={args.shutdown_timeout}"]
        dense = seq * seq * heads * 4 / 2**30
        print(
            f"{args.processes} processes x {args.devices_per_process} CPU devices, causal "
            f"attention over {seq} positions, {heads} heads ({kv_heads} key/value heads) of {dim}; "
            f"dense scores alone would be {dense:.2f} GiB in float32"
        )
        runs = launch(
            command, args.processes, devices=args.devices_per_process, timeout=args.timeout
        )
        for i, run in enumerate(runs):
            lines = [line for line in run.stdout.splitlines() if line.startswith("process")]
            print("\n".join(lines) or f"process {i}: no output")
            if run.returncode:
                why = "timed out" if run.timed_out else f"exit status {run.returncode}"
                print(f"process {i} failed ({why}):\n{run.stderr[-3000:]}", file=sys.stderr)
        return int(any(run.returncode for run in runs))
    join(args)
    print(attend(seq, heads, kv_heads, dim, check_all=args.short), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
