"""The demo: its --quick run shows the outcome it must, and its parts do what they say."""

import contextlib
import dataclasses
import functools
import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb
from PIL import Image

from jax_sdpa import demo
from jax_sdpa.demo import _training

# End to end (-m "not slow" leaves it out); one worker runs the whole file, sharing its fixtures.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("demo")]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    # optax's Adam mixes int32 counts and floats
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(printed):
        demo.main(["--quick", "--out", str(out), "--no-progress"])
    return out, json.loads((out / "results.json").read_text()), printed.getvalue()


# A run of its own, smaller than --quick and with sizes no other test uses, so that its training
# programs are compiled here and can be counted.
TINY = dataclasses.replace(
    demo.DemoConfig.quick(seeds=2), d_ks=(8, 32), steps=20, log_every=10, init_queries=64
)


@pytest.fixture(scope="module")
def tiny_run():
    program = _training._train_seeds_and_variants
    calls = []

    def counted(params, orders, scales, *examples, config):
        calls.append({"w_q": params["w_q"].shape, "orders": orders.shape, "scales": scales.shape})
        return program(params, orders, scales, *examples, config=config)

    compiled_before = program._cache_size()
    with pytest.MonkeyPatch.context() as patch, jax.numpy_dtype_promotion("standard"):
        patch.setattr(_training, "_train_seeds_and_variants", counted)
        output = demo.run(TINY, show_progress=False)
    return output, calls, program._cache_size() - compiled_before


def test_results_json_layout(quick_run):
    _, results, _ = quick_run
    d_ks = results["d_k"]
    assert d_ks == [16, 64, 256]
    seeds = results["config"]["seeds"]
    for variant in ("unscaled", "scaled"):
        for name in (
            "final_loss",
            "max_weight",
            "entropy",
            "std_qk",
            "jacobian_norm",
            "grad_norm_wq",
        ):
            assert len(results[variant][name]) == len(d_ks), (variant, name)
            assert all(math.isfinite(x) for x in results[variant][name])
        assert np.shape(results[variant]["final_loss_per_seed"]) == (len(d_ks), seeds)
    assert set(results["ratios"]) == {"loss", "grad_norm_wq_over_sqrt_dk"}
    for name in results["ratios"]:
        for ratio in results["ratios"][name]:
            per_seed = np.array(ratio["per_seed"])
            assert per_seed.shape == (seeds,)
            assert ratio["median"] == pytest.approx(np.median(per_seed))
            assert (ratio["min"], ratio["max"]) == (per_seed.min(), per_seed.max())


def test_loss_ratios_are_taken_seed_by_seed(quick_run):
    _, results, _ = quick_run
    unscaled = np.array(results["unscaled"]["final_loss_per_seed"])
    scaled = np.array(results["scaled"]["final_loss_per_seed"])
    per_seed = np.array([r["per_seed"] for r in results["ratios"]["loss"]])
    np.testing.assert_allclose(per_seed, unscaled / scaled, rtol=1e-6)


def test_gradient_ratio_is_divided_by_sqrt_dk(tiny_run):
    output, _, _ = tiny_run
    results, curves = output["results"], output["curves"]
    for i, d_k in enumerate(TINY.d_ks):
        unscaled, scaled = (curves[(d_k, v)]["grad_norm_wq"].mean(axis=1) for v in demo.VARIANTS)
        np.testing.assert_allclose(
            results["ratios"]["grad_norm_wq_over_sqrt_dk"][i]["per_seed"],
            unscaled / scaled / np.sqrt(d_k),
            rtol=1e-5,
        )


def test_gradient_ratio_without_the_chain_rule_factor_is_of_order_1(quick_run):
    _, results, _ = quick_run
    for ratio in results["ratios"]["grad_norm_wq_over_sqrt_dk"]:
        assert 0.5 < ratio["min"] <= ratio["max"] < 2


def test_unscaled_scores_grow_like_sqrt_dk_and_scaled_stay_unit(quick_run):
    _, results, _ = quick_run
    d_ks = np.array(results["d_k"])
    np.testing.assert_allclose(results["unscaled"]["std_qk"], np.sqrt(d_ks), rtol=0.15)
    np.testing.assert_allclose(results["scaled"]["std_qk"], 1.0, rtol=0.15)


def test_unscaled_softmax_saturates_while_scaled_stays_flat(quick_run):
    _, results, _ = quick_run
    unscaled, scaled = results["unscaled"], results["scaled"]
    d_ks = results["d_k"]
    assert np.all(np.diff(unscaled["max_weight"]) > 0)  # sharper as d_k grows
    assert all(w > 0.9 for d, w in zip(d_ks, unscaled["max_weight"], strict=True) if d >= 256)
    assert max(scaled["max_weight"]) - min(scaled["max_weight"]) < 0.05
    assert np.all(np.diff(unscaled["jacobian_norm"]) < 0)  # gradients through softmax vanish
    assert max(scaled["jacobian_norm"]) / min(scaled["jacobian_norm"]) < 1.1


def test_unscaled_model_learns_at_least_10x_worse_at_dk_256(quick_run):
    _, results, _ = quick_run
    ratios = results["ratios"]["loss"]
    i = results["d_k"].index(256)
    assert ratios[i]["median"] >= 10
    assert ratios[i]["min"] > 3  # every seed, not only the typical one
    assert np.all(np.diff([r["median"] for r in ratios]) > 0)  # the larger d_k, the worse


def test_table_reports_each_ratio_as_median_and_range(quick_run):
    _, results, printed = quick_run
    assert "median (min–max) over 3 seeds" in printed
    number = r"([0-9.e+-]+)"
    spread = re.compile(rf"{number} \({number}–{number}\)×")
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "×" in line]
    assert len(rows) == len(results["d_k"])
    for i, row in enumerate(rows):
        cells = spread.findall(row)
        assert len(cells) == 2, row  # the loss ratio and the ‖∇W_q‖ ratio ÷ √d_k
        for name, cell in zip(("loss", "grad_norm_wq_over_sqrt_dk"), cells, strict=True):
            median, low, high = map(float, cell)
            assert low <= median <= high
            expected = results["ratios"][name][i]
            np.testing.assert_allclose(
                (median, low, high),
                (expected["median"], expected["min"], expected["max"]),
                rtol=6e-3,
            )


def test_plots_and_animation_are_written(quick_run):
    out, _, _ = quick_run
    for name in (
        "loss_curves.png",
        "entropy.png",
        "gradient_norms.png",
        "final_loss.png",
        "weights_heatmaps.png",
    ):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    gif = out / "weighted_sum.gif"
    weights, _ = demo.weighted_sum_example()
    with Image.open(gif) as image:
        assert image.format == "GIF"
        assert image.n_frames == len(weights) + 1  # the empty sum, then one term per frame
    assert gif.stat().st_size < 1_000_000


def test_printed_time_is_the_recorded_one(quick_run):
    _, results, printed = quick_run
    assert printed.rstrip().endswith(f"in {results['wall_time_s']:.1f} s")


def test_each_d_k_is_one_compiled_program_for_all_seeds_and_variants(tiny_run):
    _, calls, compiled = tiny_run
    assert calls == [
        {"w_q": (TINY.seeds, TINY.d_model, d_k), "orders": (TINY.seeds, TINY.steps), "scales": (2,)}
        for d_k in TINY.d_ks
    ]
    assert compiled == len(TINY.d_ks)


def test_median_plots_show_the_range_over_seeds_as_a_band(tiny_run):
    import matplotlib.pyplot as plt

    output, _, _ = tiny_run
    figs = demo.figures(output)
    n = len(TINY.d_ks)
    bands_per_axes = {
        "loss_curves.png": [2] * n,  # one per variant
        "entropy.png": [2] * n,
        "gradient_norms.png": [0, 1],  # the Jacobian at init has no seeds; the ratio has a band
        "final_loss.png": [2, 1],
        "weights_heatmaps.png": [0] * 2 * n,
    }
    assert set(figs) == set(bands_per_axes)
    for name, fig in figs.items():
        axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
        bands = [[c for c in ax.collections if isinstance(c, PolyCollection)] for ax in axes]
        assert [len(b) for b in bands] == bands_per_axes[name], name
        for ax, ax_bands in zip(axes, bands, strict=True):
            for band in ax_bands:  # around the median line of its color
                (median,) = [
                    line
                    for line in ax.get_lines()
                    if to_rgb(line.get_color()) == tuple(band.get_facecolor()[0][:3])
                ]
                edge = band.get_paths()[0].vertices[:, 1]
                assert edge.min() <= np.min(median.get_ydata()), name
                assert np.max(median.get_ydata()) <= edge.max(), name
                assert edge.max() > edge.min(), name  # the seeds differ: the band has a width
        plt.close(fig)


def test_vmapped_training_matches_each_model_trained_alone():
    config = dataclasses.replace(demo.DemoConfig.quick(seeds=2), steps=50, log_every=10)
    d_k, seed = 64, 1
    batches, held_out = demo.draw_examples(config)
    with jax.numpy_dtype_promotion("standard"):
        together = demo.train(d_k, config)
        alone = jax.jit(functools.partial(demo.train_model, config=config))
        for variant in demo.VARIANTS:
            logs = alone(
                demo.init_params(seed, d_k, config),
                scale=demo.scale_for(variant, d_k),
                order=demo.batch_order(seed, config),
                batches=batches,
                held_out=held_out,
            )
            for name, value in logs.items():
                np.testing.assert_allclose(
                    value, together[variant][name][seed], rtol=1e-5, err_msg=f"{variant} {name}"
                )


def test_running_sums_add_one_term_at_a_time_largest_weight_first():
    weights, value = demo.weighted_sum_example()
    order, sums = demo.running_sums(weights, value)
    assert sums.shape == (len(weights) + 1, value.shape[1])
    np.testing.assert_allclose(weights.sum(), 1.0, rtol=1e-6)
    assert np.all(np.diff(weights[order]) <= 0)  # largest weight first
    terms = weights[order, None].astype(np.float64) * value[order]
    expected = np.concatenate([np.zeros((1, value.shape[1])), np.cumsum(terms, axis=0)])
    np.testing.assert_allclose(sums, expected, rtol=1e-5, atol=1e-6)


def test_spread_reduces_over_the_given_axis():
    per_seed = np.array([[1.0, 5.0, 3.0], [20.0, 40.0, 60.0]])
    assert demo.spread(per_seed, axis=1) == {
        "median": [3.0, 40.0],
        "min": [1.0, 20.0],
        "max": [5.0, 60.0],
    }
    assert demo.spread(per_seed[0]) == {"median": 3.0, "min": 1.0, "max": 5.0}


def test_scale_for_refuses_an_unknown_variant():
    assert demo.scale_for("scaled", 16) == 0.25 and demo.scale_for("unscaled", 16) == 1.0
    with pytest.raises(ValueError, match="`variant` must be one of .*; got 'half'"):
        demo.scale_for("half", 16)


def test_config_refuses_steps_not_a_multiple_of_log_every():
    with pytest.raises(ValueError, match="`steps` must be a multiple of `log_every` = 25; got 60"):
        demo.DemoConfig(steps=60, log_every=25)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"seeds": 0}, "`seeds` must be positive; got 0."),
        ({"steps": -10}, "`steps` must be positive; got -10."),
        ({"learning_rate": 0.0}, "`learning_rate` must be positive; got 0.0."),
        ({"noise": -0.5}, "`noise` must be at least 0; got -0.5."),
        ({"d_ks": ()}, "`d_ks` must be a non-empty tuple of positive integers; got ()."),
        ({"d_ks": [16]}, "`d_ks` must be a non-empty tuple of positive integers; got [16]."),
        ({"normalizer": "tanh"}, "`normalizer` must be 'softmax' or 'sigmoid'; got 'tanh'."),
        ({"qk_clip": 0.0}, "`qk_clip` must be positive or None; got 0.0."),
    ],
)
def test_config_refuses_sizes_it_cannot_run(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        demo.DemoConfig(**change)


def test_command_line_reports_a_bad_config_and_the_quick_sizes(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--seeds", "0"])
    assert "`seeds` must be positive; got 0." in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    quick = demo.DemoConfig.quick()
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(d_k ≤ {max(quick.d_ks)}, {quick.steps} steps, {quick.seeds} seeds)" in help_text


def test_the_package_imports_its_optional_dependencies_only_with_the_parts_that_use_them():
    # None in sys.modules makes an import fail, as if the package were not installed.
    script = """
import sys
sys.modules.update(matplotlib=None, optax=None, tqdm=None)
import jax_sdpa
assert "jax_sdpa.demo" not in sys.modules, "import jax_sdpa imports the demo"
from jax_sdpa.demo import VARIANTS, DemoConfig, init_statistics, scale_for, spread
assert DemoConfig.quick().d_ks == (16, 64, 256) and VARIANTS == ("unscaled", "scaled")
try:
    from jax_sdpa.demo import train
except ImportError as error:
    print(error)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "optax" in result.stdout  # Part B imports it at its top


def test_python_m_runs_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "jax_sdpa.demo", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m jax_sdpa.demo")
    assert "Why attention divides by √d_k, measured." in result.stdout
