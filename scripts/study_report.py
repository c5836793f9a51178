#!/usr/bin/env python
"""The study report: ``docs/results.md`` and its plots, from run records (``train/records.py``).

    python scripts/study_report.py                          # results/study -> docs/results.md, docs/images/study_*.png
    python scripts/study_report.py sweeps/study_backends    # straight from sweep dirs (record.json per job)
    python scripts/study_report.py results/study --out /tmp/r.md --images /tmp/img

Records are grouped by corpus and by *context* (a job's overrides without the residual preset and the
seed: "" for the main protocol, ``model=scale_s`` in the scaling study); inside a context the residual
presets are compared, paired by seed. Intervals are two-sided 95% Student t intervals of the mean
paired difference over the seeds both variants ran. A claim "A < B" (A's loss lower) *holds* when the
interval of A - B lies below 0, *does not hold* when it lies above 0, and is *inconclusive* otherwise.
The scaling study's iso-loss compute multiplier reads the compute frontier of the validation curves (every
evaluation of every size, seed mean; the points no cheaper point beats): ``C_vanilla(L) / C_backend(L)``
at a target loss L, with a power law ``E + A * C^-alpha`` fitted to each frontier as a check; its interval
comes from a bootstrap over seeds (one resample of the seed set per replicate, shared by every cell, which
keeps the pairing).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from msar_train.train.records import load_records  # noqa: E402

# The papers' claims, checked on every corpus where both sides ran. (a, b): "a's loss is lower than b's".
BACKEND_CLAIMS = [
    ("msar", "vanilla", "MSAR beats vanilla"),
    ("msar", "mhc", "MSAR beats mHC"),
    ("msar", "attnres", "MSAR beats Block AttnRes"),
    ("attnres", "vanilla", "Block AttnRes beats vanilla"),
    ("mhc", "vanilla", "mHC beats vanilla"),
]
ORDER = ["vanilla", "mhc", "attnres", "attnres_full", "msar", "msar_full", "msar_no_conv", "msar_mean_fusion", "msar_m2", "msar_m8",
         "msar_b2", "msar_b4"]  # fmt: skip
PAPER = {
    "msar": "1.58x iso-loss compute vs vanilla; best of all four at 18B/28B",
    "attnres": "1.35x (MSAR paper), 1.25x (AttnRes paper)",
    "mhc": "1.30x",
}
SUFFICE = 0.02  # nats: "about 8 blocks suffice" = Full MSAR is not better than Block MSAR (8) by more than this


# ------------------------------------------------------------------------------------- statistics
def t_interval(d: np.ndarray) -> tuple[float, float, float] | None:
    """(mean, low, high) of a 95% t interval; None with fewer than 2 values."""
    from scipy import stats

    if len(d) < 2:
        return None
    m, s = float(np.mean(d)), float(np.std(d, ddof=1))
    h = float(stats.t.ppf(0.975, len(d) - 1)) * s / math.sqrt(len(d))
    return m, m - h, m + h


def verdict(ci: tuple[float, float, float] | None) -> str:
    if ci is None:
        return "inconclusive (fewer than 2 paired seeds)"
    if ci[2] < 0:
        return "holds"
    if ci[1] > 0:
        return "does not hold"
    return "inconclusive"


def fmt_ci(ci: tuple[float, float, float] | None) -> str:
    return "n/a" if ci is None else f"{ci[0]:+.4f} [{ci[1]:+.4f}, {ci[2]:+.4f}]"


# --------------------------------------------------------------------------------------- grouping
def residual_of(rec: dict) -> str:
    return rec.get("choices", {}).get("residual") or rec["config"]["residual"]["name"]


def context_of(rec: dict) -> str:
    """The variant without its residual preset: the setting in which presets are compared."""
    parts = [p for p in rec["variant"].split(",") if p and p != "default" and not p.startswith("residual=")]
    return ",".join(parts)


def label_of(rec: dict) -> str:
    """Residual preset plus any residual.* override (e.g. ``msar residual.n_blocks=2``)."""
    extra = [p for p in rec["variant"].split(",") if p.startswith("residual.")]
    return " ".join([residual_of(rec), *extra])


def final_loss(rec: dict) -> float | None:
    v = rec["final"]["val_loss"]
    return None if v is None else float(v)


class Table:
    """Final validation losses by (corpus, context, label) -> {seed: loss}, finished runs only."""

    def __init__(self, records: list[dict]):
        self.loss: dict[tuple[str, str, str], dict[int, float]] = defaultdict(dict)
        self.recs: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
        for r in records:
            if r["status"] != "finished" or final_loss(r) is None:
                continue
            key = (r["corpus"], context_of(r), label_of(r))
            self.loss[key][int(r["seed"])] = final_loss(r)
            self.recs[key].append(r)

    def labels(self, corpus: str, context: str) -> list[str]:
        found = {k[2] for k in self.loss if k[0] == corpus and k[1] == context}
        return sorted(found, key=lambda lab: (ORDER.index(lab.split()[0]) if lab.split()[0] in ORDER else len(ORDER), lab))

    def paired(self, corpus: str, context: str, a: str, b: str) -> np.ndarray:
        la, lb = self.loss.get((corpus, context, a), {}), self.loss.get((corpus, context, b), {})
        seeds = sorted(set(la) & set(lb))
        return np.array([la[s] - lb[s] for s in seeds])

    def values(self, corpus: str, context: str, label: str) -> np.ndarray:
        return np.array(list(self.loss.get((corpus, context, label), {}).values()))


# ----------------------------------------------------------------------------------------- tables
def seed_section(tab: Table, corpora: list[str]) -> list[str]:
    """The spread of the protocol and what it means for the number of seeds."""
    from scipy import stats

    out = ["## Seed-to-seed spread and the size of the study", ""]
    out.append(
        "Final validation loss of the main protocol over every seed that ran. The paired spread is the standard "
        "deviation over seeds of (variant - vanilla) with the same seed (same data order). The half-width of a 95% "
        "interval of a mean paired difference over n seeds is t(0.975, n-1) * sd / sqrt(n); the table gives it for "
        "n = 3 and 5 and the smallest n that resolves 0.02 and 0.05 nats."
    )
    out += ["", "| corpus | variant | seeds | mean | sd | paired sd vs vanilla | half-width n=3 | n=5 | n for 0.02 | n for 0.05 |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def need(sd: float, target: float) -> str:
        for n in range(2, 201):
            if stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) <= target:
                return str(n)
        return "> 200"

    for corpus in corpora:
        for lab in tab.labels(corpus, ""):
            v = tab.values(corpus, "", lab)
            if len(v) < 4:
                continue
            d = tab.paired(corpus, "", lab, "vanilla") if lab != "vanilla" else v
            sd = float(np.std(d, ddof=1)) if len(d) > 1 else float("nan")
            if lab == "vanilla":
                # vanilla's own difference to a fixed reference has the unpaired spread; a paired difference
                # of two independent-looking runs would have sqrt(2) times it: the conservative case
                sd = math.sqrt(2) * float(np.std(v, ddof=1))
            h3 = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
            h5 = stats.t.ppf(0.975, 4) * sd / math.sqrt(5)
            psd = f"{sd:.4f}" + (" (sqrt 2 x sd)" if lab == "vanilla" else "")
            out.append(f"| {corpus} | {lab} | {len(v)} | {v.mean():.4f} | {np.std(v, ddof=1):.4f} | {psd} | {h3:.4f} | {h5:.4f} | "
                       f"{need(sd, 0.02)} | {need(sd, 0.05)} |")  # fmt: skip
    if out[-1].startswith("|---"):  # no row: say why instead of an empty table
        out = out[:-2] + ["No variant has the 4 or more seeds this table needs yet (`study_seeds` runs seeds 1-5)."]
    return out + [""]


def comparison_table(tab: Table, corpus: str, context: str, title: str) -> list[str]:
    labels = tab.labels(corpus, context)
    if not labels:
        return []
    van = "vanilla" if "vanilla" in labels else None
    att = "attnres" if "attnres" in labels else None
    base_rec = tab.recs[(corpus, context, van or labels[0])][0]
    out = [f"### {title}", "", "| variant | seeds | val loss mean +- sd | vs vanilla: mean diff [95% CI] | vs attnres: mean diff [95% CI] "
           "| FLOPs/token x vanilla | wall time per run s (x vanilla) |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for lab in labels:
        v = tab.values(corpus, context, lab)
        sd = f"{np.std(v, ddof=1):.4f}" if len(v) > 1 else "n/a"
        dv = fmt_ci(t_interval(tab.paired(corpus, context, lab, van))) if van and lab != van else "-"
        da = fmt_ci(t_interval(tab.paired(corpus, context, lab, att))) if att and lab != att else "-"
        recs = tab.recs[(corpus, context, lab)]
        fl = recs[0]["flops_per_token"] / base_rec["flops_per_token"]
        wall = float(np.mean([r["wall_time_s"] for r in recs]))
        wall_van = float(np.mean([r["wall_time_s"] for r in tab.recs[(corpus, context, van)]])) if van else None
        wt = f"{wall:.0f}" + (f" ({wall / wall_van:.2f}x)" if wall_van else "")
        out.append(f"| {lab} | {len(v)} | {v.mean():.4f} +- {sd} | {dv} | {da} | {fl:.4f} | {wt} |")
    return out + [""]


def claim_rows(tab: Table, corpus: str) -> list[tuple[str, str, str, str]]:
    """(claim, paper, ours, verdict) for every claim both sides of which ran on ``corpus``."""
    rows = []
    have = set(tab.labels(corpus, ""))
    for a, b, text in BACKEND_CLAIMS:
        if a in have and b in have:
            ci = t_interval(tab.paired(corpus, "", a, b))
            rows.append((text, f"{a} < {b}", f"{a} - {b} = {fmt_ci(ci)}", verdict(ci)))
    if {"msar", "msar_no_conv", "msar_mean_fusion"} <= have:
        # removing the convs costs more than removing adaptive fusion: L(no_conv) - L(mean_fusion) > 0
        ci = t_interval(tab.paired(corpus, "", "msar_mean_fusion", "msar_no_conv"))
        rows.append(("Conv expansion matters more than adaptive fusion", "L(msar_no_conv) > L(msar_mean_fusion)",
                     f"msar_mean_fusion - msar_no_conv = {fmt_ci(ci)}", verdict(ci)))  # fmt: skip
    if {"msar", "msar_m2", "attnres"} <= have:
        gain4 = -tab.paired(corpus, "", "msar", "attnres")
        gain2 = -tab.paired(corpus, "", "msar_m2", "attnres")
        n = min(len(gain2), len(gain4))
        g4, g2 = t_interval(gain4), t_interval(gain2)
        # "most of the gain": the m=2 gain over AttnRes is more than half the m=4 gain; tested as
        # gain2 - gain4 / 2 > 0, paired by seed (needs a real m=4 gain first)
        half = gain2[:n] - gain4[:n] / 2 if n else np.array([])
        ci = t_interval(half)
        if g4 is None or g4[1] <= 0:
            v = "inconclusive (no significant gain of msar over attnres to share)" if g4 is not None else verdict(None)
        else:
            v = "holds" if ci[1] > 0 else ("does not hold" if ci[2] < 0 else "inconclusive")
        rows.append(("2 streams capture most of the gain", "gain(m=2) > gain(m=4) / 2 over AttnRes",
                     f"gain m=4 {fmt_ci(g4)}, m=2 {fmt_ci(g2)}; m2 - m4/2 = {fmt_ci(ci)}", v))  # fmt: skip
    if {"msar", "msar_full"} <= have:
        ci = t_interval(tab.paired(corpus, "", "msar", "msar_full"))
        if ci is None:
            v = verdict(None)
        else:
            v = "holds" if ci[2] < SUFFICE else ("does not hold" if ci[1] > SUFFICE else "inconclusive")
        rows.append((f"About 8 blocks suffice (Full MSAR better by < {SUFFICE} nats)", f"msar - msar_full < {SUFFICE}",
                     f"msar - msar_full = {fmt_ci(ci)}", v))  # fmt: skip
    for fewer in ("msar_b2", "msar_b4"):
        if {"msar", fewer} <= have:
            ci = t_interval(tab.paired(corpus, "", "msar", fewer))
            rows.append((f"8 blocks beat {fewer[-1]}", f"msar < {fewer}", f"msar - {fewer} = {fmt_ci(ci)}", verdict(ci)))
    return rows


# ------------------------------------------------------------------------------------------ plots
def plot_curves(tab: Table, corpora: list[str], path: Path, labels_wanted: list[str] | None, title: str) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [c for c in corpora if tab.labels(c, "")]
    if not cols:
        return None
    fig, axes = plt.subplots(1, len(cols), figsize=(6.5 * len(cols), 4.5), squeeze=False)
    for ax, corpus in zip(axes[0], cols):
        for lab in tab.labels(corpus, ""):
            if labels_wanted is not None and lab not in labels_wanted:
                continue
            curves = [np.array(r["val_curve"]) for r in tab.recs[(corpus, "", lab)]]
            n = min(len(c) for c in curves)
            flops = curves[0][:n, 2]
            losses = np.stack([c[:n, 3] for c in curves])
            mean = losses.mean(0)
            ax.plot(flops, mean, label=f"{lab} (n={len(curves)})")
            if len(curves) > 1:
                sd = losses.std(0, ddof=1)
                ax.fill_between(flops, mean - sd, mean + sd, alpha=0.2)
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs (analytic)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(f"{title}: {corpus} (bands: +-1 sd over seeds)")
        ax.grid(alpha=0.3)
        # the interesting part is the end of training: zoom on the last 60% of the FLOPs axis
        lo = min(ln.get_ydata()[len(ln.get_ydata()) // 3] for ln in ax.get_lines()) if ax.get_lines() else None
        if lo is not None:
            ends = [ln.get_ydata()[-1] for ln in ax.get_lines()]
            ax.set_ylim(min(ends) - 0.05, lo + 0.05)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ablation(tab: Table, corpora: list[str], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = [c for c in corpora if "msar" in tab.labels(c, "")]
    if not cols:
        return None
    fig, axes = plt.subplots(1, len(cols), figsize=(6.5 * len(cols), 4.5), squeeze=False)
    for ax, corpus in zip(axes[0], cols):
        labs = [lab for lab in tab.labels(corpus, "") if lab != "msar"]
        means, errs = [], []
        for lab in labs:
            ci = t_interval(tab.paired(corpus, "", lab, "msar"))
            d = tab.paired(corpus, "", lab, "msar")
            means.append(ci[0] if ci else (float(d.mean()) if len(d) else float("nan")))
            errs.append(ci[2] - ci[0] if ci else 0.0)
        ax.bar(range(len(labs)), means, yerr=errs, capsize=4, color=["tab:red" if m > 0 else "tab:green" for m in means])
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xticks(range(len(labs)), labs, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("val loss - msar (nats), 95% CI over seeds")
        ax.set_title(f"ablation vs Block MSAR: {corpus} (above 0 = worse than msar)")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- scaling
def fit_power(c: np.ndarray, y: np.ndarray) -> tuple[float, float, float, float] | None:
    """Least squares ``y = E + A * (c / c0)^-alpha`` with E >= 0 below min(y), 0 < alpha <= 3;
    returns (E, A, alpha, c0) or None when it does not converge."""
    from scipy.optimize import curve_fit

    c0 = float(np.exp(np.mean(np.log(c))))
    x = c / c0

    def f(x, E, A, alpha):
        return E + A * x ** (-alpha)

    best = None
    for a0 in (0.1, 0.3, 0.7, 1.5):
        p0 = [max(0.0, float(y.min()) - 0.5), 0.5, a0]
        try:
            p, _ = curve_fit(f, x, y, p0=p0, bounds=([0.0, 1e-9, 1e-3], [float(y.min()), 1e3, 3.0]), maxfev=20000)
        except (RuntimeError, ValueError):
            continue
        sse = float(np.sum((f(x, *p) - y) ** 2))
        if best is None or sse < best[0]:
            best = (sse, p)
    if best is None:
        return None
    E, A, alpha = (float(v) for v in best[1])
    return E, A, alpha, c0


def compute_at(fit: tuple[float, float, float, float], loss: float) -> float:
    E, A, alpha, c0 = fit
    if loss <= E:
        return float("inf")
    with np.errstate(over="ignore"):
        return float(c0 * np.float64(A / (loss - E)) ** (1.0 / alpha))


def mean_curves(curves: dict, corpus: str, b: str, models: list[str], seed_sample: list[int]) -> list[tuple[float, float]]:
    """(C, mean validation loss over ``seed_sample``) at every evaluation of every model size of backend ``b``."""
    pts = []
    for m in models:
        cell = curves.get((corpus, b, m), {})
        runs = [cell[s] for s in seed_sample if s in cell]
        if not runs:
            continue
        common = set.intersection(*[set(r) for r in runs])  # steps every sampled seed evaluated
        for step in sorted(common):
            pts.append((float(np.mean([r[step][0] for r in runs])), float(np.mean([r[step][1] for r in runs]))))
    return pts


def frontier(pts: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The compute frontier: the points that no point of smaller or equal compute beats (running minimum
    of the loss over compute, over every size's curve). Returns (C, loss), C increasing, loss decreasing."""
    cs, ls = [], []
    for c, loss in sorted(pts):
        if not ls or loss < ls[-1]:
            cs.append(c)
            ls.append(loss)
    return np.array(cs), np.array(ls)


def compute_on_frontier(c: np.ndarray, y: np.ndarray, loss: float) -> float:
    """The compute at which the frontier first reaches ``loss``: log-linear interpolation between its two
    points that bracket it; inf when it never gets that low, nan above its first point (no extrapolation)."""
    if len(c) == 0 or loss < y[-1]:
        return float("inf")
    if loss > y[0]:
        return float("nan")
    i = int(np.argmax(y <= loss))
    if i == 0:
        return float(c[0])
    f = (y[i - 1] - loss) / (y[i - 1] - y[i])
    return float(np.exp(np.log(c[i - 1]) + f * (np.log(c[i]) - np.log(c[i - 1]))))


def frontier_multiplier(res: dict[str, dict], b: str, loss: float) -> float:
    """C_vanilla(loss) / C_b(loss) on the frontiers in ``res``; inf when only vanilla misses the target, nan
    when ``b`` misses it."""
    cv = compute_on_frontier(res["vanilla"]["c"], res["vanilla"]["y"], loss)
    cb = compute_on_frontier(res[b]["c"], res[b]["y"], loss)
    return cv / cb if math.isfinite(cb) else float("nan")


def power_multiplier(fv, fb, loss: float) -> float:
    """C_vanilla(loss) / C_b(loss) on the power laws ``fv``, ``fb`` (None: no fit): as
    :func:`frontier_multiplier`, nan when ``b``'s law never reaches ``loss`` (also when vanilla's does not
    either, where the quotient would be inf / inf), inf when only vanilla's misses it."""
    if not fv or not fb:
        return float("nan")
    cb = compute_at(fb, loss)
    return compute_at(fv, loss) / cb if math.isfinite(cb) else float("nan")


def size_flops(finals: dict, corpus: str, model: str) -> float:
    """Mean training FLOPs of a model size over every backend and seed that ran it."""
    return float(np.mean([v[0] for (c, _b, m), cell in finals.items() if c == corpus and m == model for v in cell.values()]))


def interval(xs: list[float]) -> str:
    """2.5-97.5% of bootstrap multipliers, where inf (vanilla never reaches the target in a replicate) is the
    largest value and nan (the backend misses it) is dropped and counted."""
    ok = sorted(x for x in xs if not math.isnan(x))
    if not ok:
        return "n/a"
    lo, hi = ok[int(round(0.025 * (len(ok) - 1)))], ok[int(round(0.975 * (len(ok) - 1)))]
    fmt = lambda v: f"{v:.3f}" if math.isfinite(v) else "inf (vanilla does not reach it)"  # noqa: E731
    n_inf = sum(1 for x in ok if not math.isfinite(x))
    extra = f"; vanilla misses it in {n_inf}" if n_inf else ""
    dropped = len(xs) - len(ok)
    extra += f"; the backend misses it in {dropped}" if dropped else ""
    return f"[{fmt(lo)}, {fmt(hi)}] ({len(xs)} replicates{extra})"


def scaling_analysis(curves: dict, corpus: str, backends: list[str], models: list[str], seeds: list[int]) -> dict[str, dict]:
    """Per backend: the frontier of the seed-mean curves and the power law fitted to it."""
    res = {}
    for b in backends:
        c, y = frontier(mean_curves(curves, corpus, b, models, seeds))
        res[b] = {"c": c, "y": y, "fit": fit_power(c, y) if len(c) >= 4 else None}
    return res


def scaling_section(
    records: list[dict], images: Path, n_boot: int, rng: np.random.Generator, headline: list[str] | None = None
) -> tuple[list[str], Path | None]:
    """Iso-loss compute multipliers on every corpus with >= 3 model sizes of the scaling protocol; the
    multiplier nearest vanilla's best loss goes to ``headline`` as a sentence for the summary."""
    finals: dict[tuple[str, str, str], dict[int, tuple[float, float]]] = defaultdict(dict)  # (corpus, backend, model)
    curves: dict[tuple[str, str, str], dict[int, dict[int, tuple[float, float]]]] = defaultdict(dict)
    for r in records:
        if r["status"] != "finished" or final_loss(r) is None or not any(p.startswith("model=") for p in r["variant"].split(",")):
            continue
        key = (r["corpus"], residual_of(r), r["choices"].get("model", r["config"]["model"]["name"]))
        finals[key][int(r["seed"])] = (float(r["flops"]), final_loss(r))
        curves[key][int(r["seed"])] = {int(step): (float(fl), float(loss)) for step, _tok, fl, loss in r["val_curve"]}
    out = ["## Scaling: iso-loss compute multiplier", ""]
    corpora = sorted({k[0] for k in finals})
    if not corpora:
        return out + ["No scaling-study records yet (`msar-train -m experiment=study_scaling`).", ""], None
    out.append(
        "Method. Every size of the scaling study trains on the same token budget, so a size's final loss is one point of "
        "loss against compute. Here the final loss is not monotone in compute (the per-size table below: the largest "
        "size, undertrained at this budget, can end worse than a smaller one), so a power law fitted to the final "
        "losses alone is not identifiable (it needs loss to fall with compute; fitted to these four points it gave "
        "multipliers in the millions). We use the compute frontier instead, as in Chinchilla's first method: every evaluation of every "
        "size's validation curve (seed mean) is a point (C, loss), C = training FLOPs up to that evaluation (analytic, "
        "including the residual math); the frontier keeps the points that no cheaper point beats. C_backend(L) = the "
        "compute at which the frontier first reaches loss L (log-linear interpolation between the two frontier points "
        "that bracket L, no extrapolation), and the multiplier at L is C_vanilla(L) / C_backend(L): how much more "
        "compute vanilla needs to reach L. As a check, `loss(C) = E + A * C^-alpha` is fitted by least squares to each "
        "frontier (E in [0, min loss], alpha in (0, 3]) and its multiplier is shown too. Targets: the 10% and 50% "
        "points of the loss range every backend's frontier covers (10% = close to the best loss vanilla reaches). "
        f"Interval: 2.5-97.5% of a bootstrap over seeds ({n_boot} replicates; each resamples the seed set once with "
        "replacement for every cell, so pairs stay paired). Caveat: points before a run's last evaluation are taken "
        "before its cosine schedule has decayed, which favours no backend (all share the schedule) but makes "
        "the frontier a little pessimistic against a compute-optimal one with one run per budget."
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(corpora), figsize=(6.5 * len(corpora), 4.5), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        backends = sorted({k[1] for k in finals if k[0] == corpus}, key=lambda b: ORDER.index(b) if b in ORDER else 99)
        models = sorted({k[2] for k in finals if k[0] == corpus}, key=lambda m: size_flops(finals, corpus, m))
        seeds = sorted(set.intersection(*[set(finals[(corpus, b, m)]) for b in backends for m in models if (corpus, b, m) in finals]))
        out += ["", f"### {corpus}: {len(models)} sizes x {len(backends)} backends, seeds {seeds}", ""]
        if "vanilla" not in backends or len(models) < 3 or not seeds:
            out.append("Not enough sizes or seeds yet (needs vanilla and >= 3 sizes with a common seed).")
            continue
        out += ["Final validation loss per size (mean over the seeds, at the run's training FLOPs):", "",
                "| backend | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]  # fmt: skip
        for b in backends:
            cells = []
            for m in models:
                v = [finals[(corpus, b, m)][s] for s in seeds if s in finals.get((corpus, b, m), {})]
                cells.append(f"{np.mean([x[1] for x in v]):.4f} at {np.mean([x[0] for x in v]):.3g}" if v else "-")
            out.append(f"| {b} | " + " | ".join(cells) + " |")
        base = scaling_analysis(curves, corpus, backends, models, seeds)
        out += ["", "| backend | frontier points | frontier loss range | power law on the frontier: E, A, alpha |", "|---|---|---|---|"]
        for b in backends:
            f = base[b]
            fit = f["fit"]
            fs = f"{fit[0]:.4f}, {fit[1]:.4f}, {fit[2]:.4f}" if fit else "did not converge"
            out.append(f"| {b} | {len(f['c'])} | {f['y'][0]:.4f} at {f['c'][0]:.3g} .. {f['y'][-1]:.4f} at {f['c'][-1]:.3g} | {fs} |")
            line = ax.plot(f["c"], f["y"], marker=".", label=f"{b} frontier")[0]
            pts = mean_curves(curves, corpus, b, models, seeds)
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=line.get_color(), alpha=0.25, s=8)
            if fit:
                cs = np.geomspace(f["c"][0], f["c"][-1], 60)
                ax.plot(cs, fit[0] + fit[1] * (cs / fit[3]) ** (-fit[2]), "--", color=line.get_color(), lw=0.8)
        lo = max(base[b]["y"][-1] for b in backends)
        hi = min(base[b]["y"][0] for b in backends)
        targets = [lo + 0.1 * (hi - lo), lo + 0.5 * (hi - lo)] if hi > lo else []
        if not targets:
            out.append(f"\nThe frontiers' loss ranges do not overlap ({lo:.4f} > {hi:.4f}): no target loss without extrapolation.")
        resamples = [list(rng.choice(seeds, size=len(seeds), replace=True)) for _ in range(n_boot if targets and len(seeds) > 1 else 0)]
        boots = [scaling_analysis(curves, corpus, backends, models, smp) for smp in resamples]
        if targets:
            out += ["", "| backend | target loss | multiplier (frontier) | 95% bootstrap interval | multiplier (power law) | "
                    "95% bootstrap interval | paper |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for b in backends:
            if b == "vanilla":
                continue
            for t in targets:
                m_front = frontier_multiplier(base, b, t)
                bf = [frontier_multiplier(x, b, t) for x in boots]
                fv, fb = base["vanilla"]["fit"], base[b]["fit"]
                m_pow = power_multiplier(fv, fb, t)
                bp = [power_multiplier(x["vanilla"]["fit"], x[b]["fit"], t) for x in boots if x["vanilla"]["fit"] and x[b]["fit"]]
                iv_f = interval(bf) if boots else "n/a (one seed)"
                iv_p = interval(bp) if boots else "n/a (one seed)"
                shown_p = f"{m_pow:.3f}x" if math.isfinite(m_pow) else "undefined (a fit never reaches it)"
                out.append(f"| {b} | {t:.4f} | {m_front:.3f}x | {iv_f} | {shown_p} | {iv_p} | {PAPER.get(b, '-')} |")
                if headline is not None and t == targets[0]:
                    headline.append(f"{b} {m_front:.2f}x {iv_f.split(' (')[0]} ({corpus}, loss {t:.3f})")
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs (analytic)")
        ax.set_ylabel("validation loss (seed mean)")
        ax.set_title(f"compute frontier: {corpus} (dashed: power law fit)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    plot_path = images / "study_scaling.png"
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot_path, dpi=110)
    plt.close(fig)
    return out + [""], plot_path


# ------------------------------------------------------------------------------------------- main
def planned_jobs(experiment_dir: Path) -> dict[str, list[list[str]]]:
    """Every study's jobs, from its ``hydra.sweeper.params`` (``configs/experiment/study_*.yaml``):
    study -> the override lists of its jobs, sorted by key as Hydra names job dirs."""
    import itertools

    import yaml

    out = {}
    for path in sorted(experiment_dir.glob("study_*.yaml")):
        params = ((yaml.safe_load(path.read_text()) or {}).get("hydra") or {}).get("sweeper", {}).get("params") or {}
        if not params:
            continue
        keys = sorted(params)
        values = [[v.strip() for v in str(params[k]).split(",")] for k in keys]
        out[path.stem] = [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*values)]
    return out


def budget_section(records: list[dict], experiment_dir: Path) -> list[str]:
    """Done and remaining jobs of every study, and the CPU time of the rest, estimated from the records:
    a job takes (its training FLOPs) x (seconds per FLOP measured for its residual preset, or else for
    its residual family, or else over every record)."""
    from msar_train.config import compose_config
    from msar_train.model.flops import training_flops_per_token

    plans = planned_jobs(experiment_dir)
    if not plans:
        return []
    done = {r["name"]: r for r in records if r["status"] == "finished"}
    per_flop: dict[str, list[float]] = defaultdict(list)
    for r in done.values():
        if r.get("flops"):
            res = r.get("choices", {}).get("residual") or r["config"]["residual"]["name"]
            per_flop[res].append(r["wall_time_s"] / r["flops"])
            per_flop["family:" + r["config"]["residual"]["name"]].append(r["wall_time_s"] / r["flops"])
            per_flop["*"].append(r["wall_time_s"] / r["flops"])

    def estimate(study: str, overrides: list[str]) -> float | None:
        cfg = compose_config([f"experiment={study}", *overrides])
        res = next(o.split("=", 1)[1] for o in overrides if o.startswith("residual="))
        rates = per_flop.get(res) or per_flop.get("family:" + cfg.residual.name) or per_flop.get("*")
        if not rates:
            return None
        p = cfg.parallel
        tokens = cfg.trainer.max_steps * p.micro_batch_size * p.grad_accum * cfg.data.seq_len
        return float(np.median(rates)) * tokens * training_flops_per_token(cfg.model, cfg.residual, cfg.data.seq_len)

    out = ["## Progress and CPU budget of each study", "",
           "Jobs of each study's sweep (`configs/experiment/study_*.yaml`) with a finished record here, and the wall time "
           "of the rest, estimated as the job's training FLOPs times the seconds per FLOP measured in these records for "
           "the same residual preset (else its residual family, else all records). The rates come from the runs as they "
           "ran (one thread per job, usually two jobs on two cores), so they are this machine's, not a GPU's. A job two "
           "studies share counts in both rows and once in the total.", "",
           "| study | jobs | finished | wall time of finished h | remaining | estimated wall time of remaining h |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    seen: dict[str, float | None] = {}
    by_cfg: dict[tuple, float | None] = {}  # the seed changes neither FLOPs nor the rate
    for study, jobs in plans.items():
        names = [",".join(j) for j in jobs]
        fin = [n for n in names if n in done]
        rest = [(n, j) for n, j in zip(names, jobs) if n not in done]
        for n, j in rest:
            key = (study, *(o for o in j if not o.startswith("trainer.seed=")))
            if key not in by_cfg:
                by_cfg[key] = estimate(study, j)
            seen[n] = by_cfg[key]
        est = [seen[n] for n, _ in rest]
        est_h = "n/a" if any(e is None for e in est) else f"{sum(est) / 3600:.3g}"
        fin_h = sum(done[n]["wall_time_s"] for n in fin) / 3600
        out.append(f"| {study} | {len(names)} | {len(fin)} | {fin_h:.2f} | {len(rest)} | {est_h} |")
    all_names = {",".join(j) for jobs in plans.values() for j in jobs}
    fin_all = [n for n in all_names if n in done]
    rest_est = [seen.get(n) for n in all_names if n not in done]
    tot = "n/a" if any(e is None for e in rest_est) else f"{sum(rest_est) / 3600:.3g}"
    out.append(f"| all (distinct jobs) | {len(all_names)} | {len(fin_all)} | {sum(done[n]['wall_time_s'] for n in fin_all) / 3600:.2f} "
               f"| {len(all_names) - len(fin_all)} | {tot} |")  # fmt: skip
    out.append("")
    return out


def protocol_lines(records: list[dict]) -> list[str]:
    """What the runs share, read from their configs, and any protocol field that differs between them."""
    fields = ["trainer.max_steps", "trainer.lr", "trainer.schedule", "trainer.warmup_steps", "trainer.eval_every", "trainer.eval_batches",
              "parallel.micro_batch_size", "parallel.grad_accum", "data.seq_len", "model.name", "trainer.threads"]  # fmt: skip
    out = []
    for f in fields:
        vals = defaultdict(int)
        for r in records:
            v = r["config"]
            for k in f.split("."):
                v = v[k]
            vals[str(v)] += 1
        out.append(f"- `{f}`: " + ", ".join(f"{v} ({n} runs)" for v, n in sorted(vals.items())))
    return out


def build_report(paths: list[Path], images: Path, out_dir: Path, n_boot: int = 2000, seed: int = 0, command: str = "",
                 experiment_dir: Path = ROOT / "configs" / "experiment") -> str:  # fmt: skip
    records = load_records(paths)
    if not records:
        raise SystemExit(f"study_report: no run records under {', '.join(map(str, paths))}")
    failed = [r for r in records if r["status"] != "finished"]
    tab = Table(records)
    corpora = sorted({r["corpus"] for r in records})
    cpu_h = sum(r["wall_time_s"] for r in records) / 3600
    commits = sorted({r.get("git_commit", "unknown")[:10] for r in records})
    out = ["# Results: the papers' comparisons at CPU scale", ""]
    out.append(f"Generated by `{command or 'python scripts/study_report.py'}` on {datetime.date.today().isoformat()} from "
               f"{len(records)} run records ({len(failed)} failed), code at commits {', '.join(commits)}. "
               f"Total wall time of the runs: {cpu_h:.2f} h (start-up, training and evaluation; threads per run: `trainer.threads` below). "
               "Every number below is computed from the records; rerun the command to regenerate this file.")  # fmt: skip
    out += ["", "## Protocol", "", *protocol_lines(records), ""]
    by_exp = defaultdict(list)
    for r in records:
        by_exp[r.get("experiment", "?")].append(r["wall_time_s"])
    out += ["Wall time by the study that ran the job (a job two studies share ran once, under the first):", "",
            "| study | runs | wall time h | mean per run min |", "|---|---|---|---|"]  # fmt: skip
    out += [f"| {e} | {len(w)} | {sum(w) / 3600:.2f} | {np.mean(w) / 60:.1f} |" for e, w in sorted(by_exp.items())]
    out.append("")
    out += budget_section(records, experiment_dir)
    if failed:
        out += ["## Failed runs", "", "| run | error |", "|---|---|"]
        out += [f"| {r['name']} | {str(r.get('error'))[:200]} |" for r in failed]
        out.append("")
    out += seed_section(tab, corpora)
    out += ["## Backends and ablation", ""]
    out.append("Final validation loss (nats/token) after the protocol's budget; differences are paired by seed, "
               "negative = lower loss than the reference.")  # fmt: skip
    out.append("")
    contexts = sorted({k[1] for k in tab.loss})
    for corpus in corpora:
        for ctx in contexts:
            if any(p.startswith("model=") for p in ctx.split(",")):
                continue  # scaling-study sizes: their own section
            out += comparison_table(tab, corpus, ctx, f"{corpus}" + (f" ({ctx})" if ctx else ""))
    images.mkdir(parents=True, exist_ok=True)
    plots = []
    backends4 = ["vanilla", "mhc", "attnres", "msar"]
    p = plot_curves(tab, corpora, images / "study_backends.png", backends4, "backends")
    if p:
        plots.append(("Validation loss against training FLOPs, backends", p))
    p = plot_curves(tab, corpora, images / "study_ablation_curves.png", None, "all variants")
    if p:
        plots.append(("Validation loss against training FLOPs, every variant", p))
    p = plot_ablation(tab, corpora, images / "study_ablation.png")
    if p:
        plots.append(("Ablation: each variant minus Block MSAR", p))
    out += ["## The papers' claims", "", "| corpus | claim | tested as | ours | verdict |", "|---|---|---|---|---|"]
    verdicts = []
    for corpus in corpora:
        for claim, tested, ours, v in claim_rows(tab, corpus):
            out.append(f"| {corpus} | {claim} | {tested} | {ours} | {v} |")
            verdicts.append((corpus, claim, v))
    out += [
        "",
        "Orderings by mean final validation loss (lowest first) next to the papers' (MSAR paper, 10B ablation: "
        "MSAR < AttnRes+mHC hybrid, AttnRes, mHC < vanilla; at 18B/28B MSAR best on every benchmark):",
        "",
    ]
    for corpus in corpora:
        labs = tab.labels(corpus, "")
        means = sorted((float(tab.values(corpus, "", lab).mean()), lab) for lab in labs)
        if means:
            out.append(f"- {corpus}: " + " < ".join(f"{lab} ({m:.4f})" for m, lab in means))
    out.append("")
    headline: list[str] = []
    scal, sp = scaling_section(records, images, n_boot, np.random.default_rng(seed), headline)
    out += scal
    if sp:
        plots.append(("Scaling fits", sp))
    out += ["## Plots", ""]
    for title, path in plots:
        rel = os.path.relpath(path, out_dir)
        out += [f"{title}:", "", f"![{title}]({Path(rel).as_posix()})", ""]
    out += ["## Summary", ""]
    if verdicts:
        out += [summary_paragraph(verdicts, corpora, headline), ""]
    out.append("")
    return "\n".join(out)


def summary_paragraph(verdicts: list[tuple[str, str, str]], corpora: list[str], headline: list[str]) -> str:
    """One plain paragraph: each claim with its verdict on every corpus, grouped by how it came out."""
    per_claim: dict[str, dict[str, str]] = defaultdict(dict)
    for corpus, claim, v in verdicts:
        per_claim[claim][corpus] = v.split(" (")[0]
    groups: dict[str, list[str]] = defaultdict(list)
    for claim, by_corpus in per_claim.items():
        kinds = set(by_corpus.values())
        if len(kinds) == 1:
            where = "on every corpus" if len(by_corpus) == len(corpora) else "on " + ", ".join(sorted(by_corpus))
            groups[kinds.pop()].append(f"{claim} ({where})")
        else:
            each = ", ".join(f"{v} on {c}" for c, v in sorted(by_corpus.items()))
            groups["mixed"].append(f"{claim} ({each})")
    text = [f"At this scale ({', '.join(corpora)}; small models, one CPU budget per run), with 95% intervals over seeds:"]
    names = {"holds": "These claims hold", "does not hold": "These do not hold", "inconclusive": "These are inconclusive (the interval "
             "contains zero)", "mixed": "These differ between corpora"}  # fmt: skip
    for kind in ("holds", "does not hold", "inconclusive", "mixed"):
        if groups[kind]:
            text.append(f"{names[kind]}: " + "; ".join(groups[kind]) + ".")
    if headline:
        text.append("Iso-loss compute multiplier over vanilla near vanilla's best loss, from the compute frontier: " + "; ".join(headline)
                    + ", against the paper's 1.35x (AttnRes) and 1.58x (MSAR) at 10B+ scale.")  # fmt: skip
    return " ".join(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="*", type=Path, default=[ROOT / "results" / "study"], help="record files, records dirs or sweep dirs")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md")
    ap.add_argument("--images", type=Path, default=None, help="plot folder (default: images/ next to --out)")
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experiments", type=Path, default=None, help="study configs (default: the config dir's experiment/)")
    a = ap.parse_args(argv)
    images = a.images or a.out.parent / "images"
    cmd = "python scripts/study_report.py " + " ".join(sys.argv[1:] if argv is None else argv)
    from msar_train.config.compose import config_dir

    text = build_report(a.paths, images, a.out.parent, a.bootstrap, a.seed, cmd.strip(), a.experiments or config_dir() / "experiment")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    print(f"wrote {a.out} and plots in {images}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
