"""The scaling study's iso-loss compute multiplier (``scripts/study_report.py``): the compute frontier and
its multiplier against cases whose answer is known."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("study_report", ROOT / "scripts" / "study_report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def test_frontier_keeps_the_points_no_cheaper_point_beats():
    # two sizes: the small one's curve, then a big one that starts worse and ends worse than it
    pts = [(1.0, 6.0), (2.0, 5.5), (4.0, 5.2), (3.0, 5.8), (6.0, 5.3), (12.0, 5.25)]
    c, y = report.frontier(pts)
    assert c.tolist() == [1.0, 2.0, 4.0] and y.tolist() == [6.0, 5.5, 5.2]
    assert report.compute_on_frontier(c, y, 5.5) == 2.0
    # log-linear between (2, 5.5) and (4, 5.2): half way in loss is sqrt(2 * 4) in compute
    assert report.compute_on_frontier(c, y, 5.35) == pytest.approx(math.sqrt(8.0))
    assert report.compute_on_frontier(c, y, 5.1) == math.inf  # never that low
    assert math.isnan(report.compute_on_frontier(c, y, 6.5))  # above its first point: no extrapolation


def curves_for(scale: float, noise: float, rng) -> dict:
    """A fake study cell set: loss = 5 + 20 * (C * scale)^-0.3 along each size's curve, 3 seeds."""
    out = {}
    for m, total in (("a", 1e9), ("b", 3e9), ("c", 9e9)):
        out[m] = {s: {step: (total * step / 8, 5 + 20 * (total * step / 8 * scale) ** -0.3 + noise * rng.standard_normal())
                      for step in range(1, 9)} for s in (1, 2, 3)}  # fmt: skip
    return out


def test_multiplier_recovers_a_known_compute_factor():
    rng = np.random.default_rng(0)
    curves = {}
    for b, scale in (("vanilla", 1.0), ("msar", 1.6)):  # msar reaches every loss with 1/1.6 of the compute
        for m, cell in curves_for(scale, 0.0, rng).items():
            curves[("x", b, m)] = cell
    res = report.scaling_analysis(curves, "x", ["vanilla", "msar"], ["a", "b", "c"], [1, 2, 3])
    lo, hi = max(res[b]["y"][-1] for b in res), min(res[b]["y"][0] for b in res)
    for t in (lo + 0.1 * (hi - lo), lo + 0.5 * (hi - lo)):
        # the frontier interpolates log-linearly between evaluations of a smooth curve: close, not exact
        assert report.frontier_multiplier(res, "msar", t) == pytest.approx(1.6, rel=0.03)
        fv, fb = res["vanilla"]["fit"], res["msar"]["fit"]
        assert report.compute_at(fv, t) / report.compute_at(fb, t) == pytest.approx(1.6, rel=0.01)
    # a backend that never gets as low as the target: nan, counted apart in the interval
    assert math.isnan(report.frontier_multiplier(res, "msar", res["msar"]["y"][-1] - 0.01))
    assert "the backend misses it in 1" in report.interval([1.5, 1.6, float("nan")])
    assert report.interval([1.0, float("inf")]).endswith("vanilla misses it in 1)")


def test_power_multiplier_names_who_misses_the_target():
    fv, fb = (5.0, 1.0, 0.5, 1.0), (4.0, 1.0, 0.5, 1.0)  # vanilla's law floors at 5.0, the backend's at 4.0
    assert report.power_multiplier(fv, fb, 4.5) == math.inf  # only vanilla never reaches 4.5
    assert math.isnan(report.power_multiplier(fb, fv, 4.5))  # the backend misses it
    assert math.isnan(report.power_multiplier(fv, fv, 4.5))  # both miss: not inf / inf counted as anything else
    assert math.isnan(report.power_multiplier(None, fb, 4.5))
    assert report.power_multiplier(fv, fv, 5.5) == pytest.approx(1.0)
