"""The demo: its --quick run shows the outcome it must, and its parts do what they say."""

import contextlib
import dataclasses
import functools
import io
import json
import math
import re

import jax
import numpy as np
import pytest
from PIL import Image

import jax_sdpa
from jax_sdpa import demo


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    printed = io.StringIO()
    # optax's Adam mixes int32 counts and floats
    with jax.numpy_dtype_promotion("standard"), contextlib.redirect_stdout(printed):
        demo.main(["--quick", "--out", str(out), "--no-progress"])
    return out, json.loads((out / "results.json").read_text()), printed.getvalue()


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
    for name in ("loss", "grad_norm_wq"):
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
        assert len(cells) == 2, row  # the loss ratio and the ‖∇W_q‖ ratio
        for name, cell in zip(("loss", "grad_norm_wq"), cells, strict=True):
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


def test_running_sums_end_at_the_weighted_sum():
    weights, value = demo.weighted_sum_example()
    order, sums = demo.running_sums(weights, value)
    assert sums.shape == (len(weights) + 1, value.shape[1])
    np.testing.assert_allclose(weights.sum(), 1.0, rtol=1e-6)
    assert np.all(np.diff(weights[order]) <= 0)  # largest weight first
    np.testing.assert_array_equal(sums[0], 0.0)
    terms = weights[order, None] * value[order]
    np.testing.assert_allclose(np.diff(sums, axis=0), terms, rtol=1e-6, atol=1e-7)
    expected = jax_sdpa.weighted_sum(weights[None, :], value)[0]
    np.testing.assert_allclose(sums[-1], expected, rtol=1e-5, atol=1e-6)


def test_config_refuses_steps_not_a_multiple_of_log_every():
    with pytest.raises(ValueError, match="`steps` must be a multiple of `log_every` = 25; got 60"):
        demo.DemoConfig(steps=60, log_every=25)
