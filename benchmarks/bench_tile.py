"""Where the chunked forward's time goes: one tile of the online softmax, stage by stage.

    python benchmarks/bench_tile.py [--reps 9] [--heads 8] [--block 512] [--profile 4096]
                                    [--allocation 2048,4096] [--blocks 4096:512x512,1024x512]
                                    [--backward] [--out benchmarks/results]

A tile is ``heads`` × ``block`` queries × ``block`` keys, d = 64, float32: the unit of work of
``implementation="chunked"`` at its default block size. Each row times a loop of 16 tiles that
stops after one more step of the update (``s = q kᵀ``; its row max; ``p = e^{s − m}`` and its row
sum; ``p v`` and the rescaled accumulator), so the difference between two rows is that step's
cost. A last row runs ``jax_sdpa.dot_product_attention`` on the same 16 tiles (T = 4·block
queries and keys), and an f32 GEMM of 2048² timed in the same loop gives the yardstick: the two
products of a tile take ``4·heads·block²·64`` flops, and the line under the table says how long
they would take at the GEMM's rate.

``--profile T`` then traces the library's forward at B1 T d64 with ``heads`` heads, causal and
not, with ``jax.profiler`` and prints the time per call of each compiled operation (the
products, the exponentials, the reductions, the copies), summed over its runs in the loops.

``--allocation T,...`` times the library's forward at those lengths, causal and not, interleaved
with the GEMM, and prints what each call costs the memory allocator: XLA's temporaries (one
block, ``memory_analysis().temp_size_in_bytes``), the minor page faults and the system CPU time
per call. Run it once plainly and once with ``MALLOC_MMAP_THRESHOLD_`` set (BENCHMARKS.md) to
see what fresh pages cost.

``--blocks T:QxK,...`` times the forward at T with each ``block_q × block_kv``, causal and not,
interleaved with the GEMM: the table the default block sizes were chosen from. With
``--backward`` it times the forward+backward instead.
"""

import argparse
import collections
import functools
import gzip
import json
import resource
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_speed import compiled, flops, interleaved  # this folder is on sys.path as a script
from jax import lax

import jax_sdpa

TILES = 16
STAGES = ("q kᵀ", "+ row max", "+ exp and row sum", "+ p v, rescale")


def tile_loop(stage: int, block: int):
    """16 online-softmax updates of one block of queries, stopping after ``stage``."""

    def run(query, key, value):
        def update(j, carry):
            row_max, denom, acc = carry
            k_j, v_j = (lax.dynamic_slice_in_dim(x, j * block, block, axis=1) for x in (key, value))
            s = jnp.einsum("hqd,hkd->hqk", query, k_j)
            if stage == 0:  # keeps the product alive without another pass over it
                return row_max, denom, acc + s[..., : acc.shape[-1]]
            new_max = jnp.maximum(row_max, s.max(axis=-1))
            if stage == 1:
                return new_max, denom, acc
            p = jnp.exp(s - new_max[..., None])
            correction = jnp.exp(row_max - new_max)
            denom = correction * denom + p.sum(axis=-1)
            if stage == 2:
                return new_max, denom, acc
            return new_max, denom, correction[..., None] * acc + jnp.einsum("hqk,hkd->hqd", p, v_j)

        heads = query.shape[0]
        start = (jnp.full((heads, block), -1e30), jnp.zeros((heads, block)), jnp.zeros_like(query))
        return lax.fori_loop(0, TILES, update, start)

    return jax.jit(run)


def profile(seq: int, heads: int, is_causal: bool, calls: int = 5, top: int = 14):
    """Milliseconds per call of each operation XLA runs for the chunked forward."""
    x = jax.random.normal(jax.random.key(0), (1, seq, heads, 64))
    sdpa = functools.partial(jax_sdpa.dot_product_attention, is_causal=is_causal)
    step = jax.jit(functools.partial(sdpa, implementation="chunked"))
    jax.block_until_ready(step(x, x, x))
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        for _ in range(calls):
            jax.block_until_ready(step(x, x, x))
        jax.profiler.stop_trace()
        trace = next(Path(folder).rglob("*.json.gz"))
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    spans, runs = collections.Counter(), collections.Counter()
    for event in events:
        name = event.get("name", "")
        if event.get("ph") == "X" and ("fusion" in name or "copy" in name) and ":" not in name:
            spans[name] += event["dur"] / 1e3 / calls
            runs[name] += 1 / calls
    print(f"\n## B1 T{seq} H{heads} d64, {'causal' if is_causal else 'not causal'}\n")
    print("| operation | ms per call | runs per call |")
    print("|---|---|---|")
    for name, ms in spans.most_common(top):
        print(f"| {name} | {ms:.2f} | {runs[name]:.0f} |")
    print(f"| (all {len(spans)} listed kinds) | {sum(spans.values()):.1f} | |")
    return {name: {"ms_per_call": ms, "runs_per_call": runs[name]} for name, ms in spans.items()}


def medians_with_gemm(steps: dict, reps: int) -> tuple[dict, float]:
    """Median seconds per call of each step, interleaved with an f32 GEMM of 2048², and its flop/s."""
    a = jax.random.normal(jax.random.key(1), (2048, 2048))
    steps = {**steps, "gemm": functools.partial(jax.jit(jnp.matmul), a, a)}
    median = {name: float(np.median(t)) for name, t in interleaved(steps, (), reps).items()}
    return median, 2 * 2048**3 / median.pop("gemm")


def allocation(seqs: list[int], heads: int, reps: int):
    """ms, page faults and system ms per call of the forward; XLA's temporaries in MiB."""
    steps, temps, calls = {}, {}, {}
    for seq in seqs:
        x = jax.random.normal(jax.random.key(0), (1, seq, heads, 64))
        for is_causal in (False, True):
            sdpa = functools.partial(
                jax_sdpa.dot_product_attention, implementation="chunked", is_causal=is_causal
            )
            step = jax.jit(sdpa)
            name = f"T{seq} {'causal' if is_causal else 'not causal'}"
            calls[name] = (seq, is_causal)
            temps[name] = step.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes
            steps[name] = functools.partial(step, x, x, x)
    usage = {}
    for name, step in steps.items():
        jax.block_until_ready(step())
        before = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(reps):
            jax.block_until_ready(step())
        after = resource.getrusage(resource.RUSAGE_SELF)
        usage[name] = (
            (after.ru_minflt - before.ru_minflt) / reps,
            (after.ru_stime - before.ru_stime) / reps,
        )
    median, gemm_rate = medians_with_gemm(steps, reps)
    print(
        f"\n## Allocation: B1 H{heads} d64 forward; f32 GEMM 2048² {gemm_rate / 1e9:.0f} GFLOP/s\n"
    )
    print(
        "| call | ms | % of GEMM | temporaries, MiB | page faults per call | system ms per call |"
    )
    print("|---|---|---|---|---|---|")
    rows = {}
    for name, seconds in median.items():
        seq, is_causal = calls[name]
        work = flops(1, heads, seq, 64, is_causal, "fwd")
        faults, system = usage[name]
        rows[name] = {
            "ms": 1e3 * seconds,
            "pct_gemm": 100 * work / seconds / gemm_rate,
            "temp_mib": temps[name] / 2**20,
            "faults_per_call": faults,
            "system_ms_per_call": 1e3 * system,
        }
        print(
            f"| {name} | {1e3 * seconds:.1f} | {rows[name]['pct_gemm']:.0f}% | "
            f"{temps[name] / 2**20:.0f} | {faults:.0f} | {1e3 * system:.1f} |"
        )
    return {"gemm_gflops": gemm_rate / 1e9, "calls": rows}


def block_sizes(seq: int, tiles: list[tuple[int, int]], heads: int, reps: int, backward: bool):
    """ms per call at B1 ``seq`` with each ``(block_q, block_kv)``, causal and not.

    Of the forward, or with ``backward`` of the forward+backward (gradients of the output's sum).
    """
    x = jax.random.normal(jax.random.key(0), (1, seq, heads, 64))
    mode = "fwdbwd" if backward else "fwd"
    steps = {}
    for tile in tiles:
        for is_causal in (False, True):
            sdpa = functools.partial(
                jax_sdpa.dot_product_attention,
                implementation=jax_sdpa.Chunked(*tile),
                is_causal=is_causal,
            )
            step, _ = compiled(sdpa, mode, (x, x, x))
            steps[f"{tile} {is_causal}"] = functools.partial(step, x, x, x)
    median, gemm_rate = medians_with_gemm(steps, reps)
    title = "forward+backward" if backward else "forward"
    print(
        f"\n## Block sizes: B1 T{seq} H{heads} d64 {title}; f32 GEMM 2048² {gemm_rate / 1e9:.0f} GFLOP/s\n"
    )
    print("| tile | non-causal ms | % of GEMM | causal ms | causal speed-up |")
    print("|---|---|---|---|---|")
    rows = {}
    for block_q, block_kv in tiles:
        full, causal = (median[f"{(block_q, block_kv)} {c}"] for c in (False, True))
        pct = 100 * flops(1, heads, seq, 64, False, mode) / full / gemm_rate
        rows[f"{block_q}x{block_kv}"] = {
            "ms": 1e3 * full,
            "pct_gemm": pct,
            "causal_ms": 1e3 * causal,
        }
        print(
            f"| {block_q} × {block_kv} | {1e3 * full:.1f} | {pct:.0f}% | {1e3 * causal:.1f} | "
            f"{full / causal:.2f}× |"
        )
    return {"seq": seq, "mode": title, "gemm_gflops": gemm_rate / 1e9, "tiles": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--profile", type=int, metavar="T", help="also profile the forward at T")
    parser.add_argument(
        "--allocation", metavar="T,...", help="also measure the allocator's cost at these T"
    )
    parser.add_argument(
        "--blocks",
        metavar="T:QxK,...",
        help="also time the forward at T with these block sizes, e.g. 4096:512x512,1024x512",
    )
    parser.add_argument(
        "--backward", action="store_true", help="with --blocks: time forward+backward instead"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    heads, block, dim = args.heads, args.block, 64
    keys = jax.random.split(jax.random.key(0), 4)
    query = jax.random.normal(keys[0], (heads, block, dim))
    key, value = (jax.random.normal(k, (heads, TILES * block, dim)) for k in keys[1:3])
    steps = {
        name: functools.partial(tile_loop(n, block), query, key, value)
        for n, name in enumerate(STAGES)
    }
    # The library on the same 16 tiles: 4 query blocks × 4 key blocks.
    seq = jax.random.normal(keys[3], (1, 4 * block, heads, dim))
    sdpa = jax.jit(functools.partial(jax_sdpa.dot_product_attention, implementation="chunked"))
    steps["jax_sdpa, T = 4·block"] = functools.partial(sdpa, seq, seq, seq)
    median, gemm_rate = medians_with_gemm(steps, args.reps)
    results = {
        "heads": heads,
        "block": block,
        "gemm_gflops": gemm_rate / 1e9,
        "ms_per_tile": {name: 1e3 * seconds / TILES for name, seconds in median.items()},
    }
    print(f"# {heads} heads × {block} × {block} tile, d {dim}, float32; jax {jax.__version__}")
    print(f"# f32 GEMM 2048²: {gemm_rate / 1e9:.0f} GFLOP/s\n")
    print("| stages | ms per tile | this step, ms | its product vs GEMM | whole tile vs GEMM |")
    print("|---|---|---|---|---|")
    product = 2 * heads * block * block * dim  # flops of q kᵀ, and of p v
    previous = 0.0
    for name, seconds in median.items():
        per_tile = 1e3 * seconds / TILES
        cells = ["", "", ""]
        if name in STAGES:
            step, previous = per_tile - previous, per_tile
            cells[0] = f"{step:+.2f}"
            if name in (STAGES[0], STAGES[-1]):
                cells[1] = f"{100 * product / (step / 1e3) / gemm_rate:.0f}%"
        if name not in STAGES[:-1]:
            cells[2] = f"{100 * 2 * product / (per_tile / 1e3) / gemm_rate:.0f}%"
        print(f"| {name} | {per_tile:.2f} | " + " | ".join(cells) + " |")
    print(f"\nboth products of a tile at the GEMM's rate: {1e3 * 2 * product / gemm_rate:.2f} ms")
    if args.profile:
        results["profile"] = {
            f"T{args.profile} {'causal' if is_causal else 'not causal'}": profile(
                args.profile, heads, is_causal
            )
            for is_causal in (False, True)
        }
    if args.allocation:
        seqs = [int(t) for t in args.allocation.split(",")]
        results["allocation"] = allocation(seqs, heads, args.reps)
    if args.blocks:
        seq, tiles = args.blocks.split(":")
        tiles = [tuple(int(n) for n in tile.split("x")) for tile in tiles.split(",")]
        results["block_sizes"] = block_sizes(int(seq), tiles, heads, args.reps, args.backward)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
