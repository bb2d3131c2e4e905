"""Memory of attention over long sequences: jax_sdpa's chunked path vs jax.nn, one head, d = 64.

    python benchmarks/bench_memory.py [--rss-max-nn 16384] [--rss-max-bwd 65536]
                                      [--rss-long 262144 ...] [--out benchmarks/results]
    python benchmarks/bench_memory.py --mods 65536

Two measures, because XLA's ahead-of-time figure is unreliable on CPU (it has reported 0 bytes
of temporaries for a graph that grew the process by hundreds of MiB):

* AOT: ``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``;
* RSS: a fresh subprocess compiles, allocates the inputs, resets the kernel's high-water mark
  (``/proc/self/clear_refs``), runs once, and reports the peak resident memory above what it
  held just before the call.

``--mods T`` measures only the RSS growth of a chunked call with ALiBi as a ``score_mod`` and a
causal ``mask_mod`` lambda (no ranges: its tiles are classified by evaluating it).

It also finds, by AOT, the longest power-of-two sequence whose forward+backward needs at most
1 GiB of temporaries, and checks by RSS that the chunked forward+backward at ``--rss-long``
lengths (T = 262,144 by default: about 10 minutes here) grows the process by less than that.
"""

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20


def build(impl: str, mode: str):
    import jax

    import jax_sdpa

    chunked = functools.partial(jax_sdpa.dot_product_attention, implementation="chunked")
    fn = {
        "chunked": chunked,
        "jax.nn": functools.partial(jax.nn.dot_product_attention, implementation="xla"),
        "mods": functools.partial(  # ALiBi as a score_mod, causal as a mask_mod lambda
            chunked,
            score_mod=jax_sdpa.mods.alibi(jax_sdpa.mods.alibi_slopes(1)),
            mask_mod=lambda b, h, i, j: j <= i,
        ),
    }[impl]
    if mode == "fwd":
        return jax.jit(fn)
    return jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))


def aot_temp_mib(impl: str, mode: str, seq: int) -> float:
    import jax
    import jax.numpy as jnp

    shape = jax.ShapeDtypeStruct((1, seq, 1, 64), jnp.float32)
    analysis = build(impl, mode).lower(shape, shape, shape).compile().memory_analysis()
    return analysis.temp_size_in_bytes / MIB


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def rss_child(impl: str, mode: str, seq: int) -> None:
    """Runs in a subprocess: prints the RSS growth (MiB) and wall time of one call."""
    import jax
    import jax.numpy as jnp

    shape = jax.ShapeDtypeStruct((1, seq, 1, 64), jnp.float32)
    compiled = build(impl, mode).lower(shape, shape, shape).compile()
    args = [
        jax.block_until_ready(jax.random.normal(jax.random.key(i), shape.shape)) for i in range(3)
    ]
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    seconds = time.perf_counter() - start
    print(json.dumps({"rss_mib": (_status_kib("VmHWM") - before) / 1024, "seconds": seconds}))


def rss(impl: str, mode: str, seq: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", impl, mode, str(seq)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "MODE", "SEQ"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--rss-max-nn", type=int, default=16384, help="longest T to run jax.nn for RSS"
    )
    parser.add_argument(
        "--rss-max-bwd", type=int, default=65536, help="longest T to run fwd+bwd for RSS"
    )
    parser.add_argument(
        "--rss-long",
        type=int,
        nargs="*",
        default=[262144],
        help="longer T at which to measure the chunked fwd+bwd's RSS growth",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--mods",
        type=int,
        metavar="T",
        help="only the RSS growth of ALiBi (score_mod) + causal (mask_mod lambda) at this T",
    )
    args = parser.parse_args()
    if args.child:
        impl, mode, seq = args.child
        rss_child(impl, mode, int(seq))
        return
    if args.mods:
        print(f"# T = {args.mods}, one head, d = 64, f32: ALiBi score_mod + causal mask_mod")
        print("\n| mode | RSS growth | time |\n|---|---|---|")
        for mode in ("fwd", "fwdbwd"):
            row = rss("mods", mode, args.mods)
            print(f"| {mode} | {row['rss_mib']:.0f} MiB | {row['seconds']:.1f} s |", flush=True)
        return

    print(
        "# one head, d = 64, float32; MiB of temporaries (AOT) and of peak RSS growth in one call"
    )
    print(
        "\n| T | mode | chunked AOT | chunked RSS | chunked time | jax.nn AOT | jax.nn RSS | RSS ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for seq in (8192, 16384, 32768, 65536):
        for mode in ("fwd", "fwdbwd"):
            row = {"seq": seq, "mode": mode}
            row["chunked_aot"] = aot_temp_mib("chunked", mode, seq)
            row["nn_aot"] = aot_temp_mib("jax.nn", mode, seq)
            if mode == "fwd" or seq <= args.rss_max_bwd:
                row["chunked_rss"] = rss("chunked", mode, seq)
            if seq <= args.rss_max_nn and (mode == "fwd" or seq <= args.rss_max_bwd):
                row["nn_rss"] = rss("jax.nn", mode, seq)
            c_rss = row.get("chunked_rss", {}).get("rss_mib")
            n_rss = row.get("nn_rss", {}).get("rss_mib")
            fmt = lambda x, unit="": "—" if x is None else f"{x:.0f}{unit}"  # noqa: E731
            ratio = (
                f"{n_rss / max(c_rss, 1):.0f}×" if c_rss is not None and n_rss is not None else "—"
            )
            seconds = row.get("chunked_rss", {}).get("seconds")
            print(
                f"| {seq} | {mode} | {fmt(row['chunked_aot'])} | {fmt(c_rss)} | "
                f"{'—' if seconds is None else f'{seconds:.1f} s'} | {fmt(row['nn_aot'])} | {fmt(n_rss)} | {ratio} |",
                flush=True,
            )
            results.append(row)

    print("\n# longest T (powers of 2) whose forward+backward needs ≤ 1 GiB of temporaries (AOT)")
    longest = {}
    for impl in ("chunked", "jax.nn"):
        for power in range(12, 21):
            temp = aot_temp_mib(impl, "fwdbwd", 2**power)
            print(f"{impl:8s} T = {2**power:8d}: {temp:10.0f} MiB", flush=True)
            if temp > 1024:
                break
            longest[impl] = 2**power
    print(f"longest: {longest}")
    print("\n# chunked forward+backward, RSS growth in one call")
    long_rss = {}
    for seq in args.rss_long:
        long_rss[seq] = rss("chunked", "fwdbwd", seq)
        print(
            f"T = {seq}: {long_rss[seq]['rss_mib']:.0f} MiB, {long_rss[seq]['seconds']:.0f} s",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(
        json.dumps(
            {"rows": results, "longest_fwdbwd_1gib": longest, "fwdbwd_rss_long": long_rss},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
