"""The demo's --quick run: the outcome it must show, asserted on the numbers it produced."""

import json
import math

import jax
import numpy as np
import pytest

from jax_sdpa import demo


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int32 counts and floats
        demo.main(["--quick", "--out", str(out), "--no-progress"])
    return out, json.loads((out / "results.json").read_text())


def test_results_json_layout(quick_run):
    _, results = quick_run
    d_ks = results["d_k"]
    assert d_ks == [16, 64, 256]
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


def test_unscaled_scores_grow_like_sqrt_dk_and_scaled_stay_unit(quick_run):
    _, results = quick_run
    d_ks = np.array(results["d_k"])
    np.testing.assert_allclose(results["unscaled"]["std_qk"], np.sqrt(d_ks), rtol=0.15)
    np.testing.assert_allclose(results["scaled"]["std_qk"], 1.0, rtol=0.15)


def test_unscaled_softmax_saturates_while_scaled_stays_flat(quick_run):
    _, results = quick_run
    unscaled, scaled = results["unscaled"], results["scaled"]
    d_ks = results["d_k"]
    assert np.all(np.diff(unscaled["max_weight"]) > 0)  # sharper as d_k grows
    assert all(w > 0.9 for d, w in zip(d_ks, unscaled["max_weight"], strict=True) if d >= 256)
    assert max(scaled["max_weight"]) - min(scaled["max_weight"]) < 0.05
    assert np.all(np.diff(unscaled["jacobian_norm"]) < 0)  # gradients through softmax vanish
    assert max(scaled["jacobian_norm"]) / min(scaled["jacobian_norm"]) < 1.1


def test_unscaled_model_learns_at_least_10x_worse_at_dk_256(quick_run):
    _, results = quick_run
    i = results["d_k"].index(256)
    assert results["unscaled"]["final_loss"][i] >= 10 * results["scaled"]["final_loss"][i]


def test_plots_are_written(quick_run):
    out, _ = quick_run
    for name in ("loss_curves.png", "entropy.png", "gradient_norms.png", "weights_heatmaps.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
