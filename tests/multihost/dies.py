"""One process of a 2-process job in which one process dies (started by tests/test_multihost.py).

Both run ring attention step after step; at step 3 the ``--victim`` prints the wall-clock time
and dies (``--death kill``: SIGKILL, as a crashed or preempted host; ``--death raise``: an
uncaught exception). The survivor is then waiting inside a collective for a peer that will
never answer; the driver measures how long it takes to end, and with what message.
"""

import functools
import os
import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_sdpa as js

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from multihost_ring import cluster_arguments, join  # noqa: E402


def main():
    parser = cluster_arguments()
    parser.add_argument("--victim", type=int, required=True)
    parser.add_argument("--death", choices=("kill", "raise"), required=True)
    args = parser.parse_args()
    join(args)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("seq",))
    spec = P(None, "seq", None, None)
    sharding = NamedSharding(mesh, spec)
    x = np.ones((1, 32, 2, 8), np.float32)
    x = jax.make_array_from_process_local_data(sharding, x, (1, 64, 2, 8))
    ring = functools.partial(js.ring_attention, axis_name="seq", is_causal=True)
    ring = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    for step in range(1000):
        if step == 3 and jax.process_index() == args.victim:
            print(f"dies at {time.time()}", flush=True)
            if args.death == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("this process dies mid-run")
        x = ring(x, x, x).block_until_ready()
    print("survived 1000 steps", flush=True)


if __name__ == "__main__":
    main()
