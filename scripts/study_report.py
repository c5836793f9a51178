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
The scaling fit is ``loss(C) = E + A * C^-alpha`` per backend over the mean final losses of each model
size (C = training FLOPs, analytic: ``model/flops.py``), the iso-loss compute multiplier at a target
loss is ``C_vanilla(L) / C_backend(L)``, and its interval comes from a bootstrap over seeds (one
resample of the seed set per replicate, shared by every cell, which keeps the pairing).
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


def fits_for(cells: dict, corpus: str, backends: list[str], models: list[str], seed_sample: list[int]) -> dict[str, tuple]:
    """Per backend: (fit, C per size, mean loss per size) over the seeds in ``seed_sample``."""
    res = {}
    for b in backends:
        pts = []
        for m in models:
            cell = cells.get((corpus, b, m), {})
            vals = [cell[s] for s in seed_sample if s in cell]
            if vals:
                pts.append((np.mean([v[0] for v in vals]), np.mean([v[1] for v in vals])))
        if len(pts) >= 3:
            c, y = np.array(pts).T
            fit = fit_power(c, y)
            if fit is not None:
                res[b] = (fit, c, y)
    return res


def scaling_section(records: list[dict], images: Path, n_boot: int, rng: np.random.Generator) -> tuple[list[str], Path | None]:
    """Scaling fit per backend on every corpus with >= 3 model sizes of the scaling protocol."""
    cells: dict[tuple[str, str, str], dict[int, tuple[float, float]]] = defaultdict(dict)  # (corpus, backend, model)
    for r in records:
        if r["status"] != "finished" or final_loss(r) is None or not any(p.startswith("model=") for p in r["variant"].split(",")):
            continue
        cells[(r["corpus"], residual_of(r), r["choices"].get("model", r["config"]["model"]["name"]))][int(r["seed"])] = (
            float(r["flops"]),
            final_loss(r),
        )
    out = ["## Scaling: iso-loss compute multiplier", ""]
    corpora = sorted({k[0] for k in cells})
    if not corpora:
        return out + ["No scaling-study records yet (`msar-train -m experiment=study_scaling`).", ""], None
    out.append(
        "Per backend, `loss(C) = E + A * C^-alpha` fitted by least squares (E in [0, min loss], alpha in (0, 3]) "
        "to the mean final validation loss of each model size over its seeds; C = training FLOPs of the run "
        "(analytic, including the residual math). The multiplier at a target loss L is C_vanilla(L) / C_backend(L): "
        "how much more compute vanilla needs to reach L. Targets: the 25% and 75% points of the loss range every "
        "backend's fit covers without extrapolation. Interval: 2.5-97.5% of a bootstrap over seeds "
        f"({n_boot} replicates; each resamples the seed set once with replacement for every cell, so pairs stay paired). "
        "Why this fit and not the paper's: the MSAR paper reads its multipliers off fitted loss-compute curves "
        "of this same form; with one token budget per size, compute grows with model size only, so this is the "
        "compute-scaling curve at a fixed token budget, not a compute-optimal frontier (which needs several budgets "
        "per size)."
    )
    plot_path = None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(corpora), figsize=(6.5 * len(corpora), 4.5), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        backends = sorted({k[1] for k in cells if k[0] == corpus}, key=lambda b: ORDER.index(b) if b in ORDER else 99)
        models = sorted({k[2] for k in cells if k[0] == corpus})
        seeds = sorted(set.intersection(*[set(cells[(corpus, b, m)]) for b in backends for m in models if (corpus, b, m) in cells]))

        base = fits_for(cells, corpus, backends, models, seeds)
        out += ["", f"### {corpus}: {len(models)} sizes x {len(backends)} backends, seeds {seeds}", ""]
        if "vanilla" not in base or len(seeds) == 0:
            out.append("Not enough sizes or seeds for a fit yet.")
            continue
        out += ["| backend | E | A | alpha | sizes (mean final loss at C) |", "|---|---|---|---|---|"]
        for b, (fit, c, y) in base.items():
            pts = ", ".join(f"{ci:.3g}: {yi:.4f}" for ci, yi in zip(c, y))
            out.append(f"| {b} | {fit[0]:.4f} | {fit[1]:.4f} | {fit[2]:.4f} | {pts} |")
            cs = np.geomspace(c.min(), c.max(), 50)
            line = ax.plot(cs, [fit[0] + fit[1] * (x / fit[3]) ** (-fit[2]) for x in cs], label=f"{b}: E={fit[0]:.2f}, alpha={fit[2]:.2f}")[
                0
            ]
            ax.scatter(c, y, color=line.get_color())
            for m in models:
                cell = cells.get((corpus, b, m), {})
                ax.scatter([v[0] for v in cell.values()], [v[1] for v in cell.values()], color=line.get_color(), alpha=0.3, s=10)
        lo = max(min(v[2]) for v in base.values())
        hi = min(max(v[2]) for v in base.values())
        if hi <= lo:
            out.append(f"\nThe backends' loss ranges do not overlap ({lo:.4f} > {hi:.4f}): no target loss without extrapolation.")
            targets = []
        else:
            targets = [lo + 0.25 * (hi - lo), lo + 0.75 * (hi - lo)]
        resamples = [list(rng.choice(seeds, size=len(seeds), replace=True)) for _ in range(n_boot if targets else 0)]
        boots = [fits_for(cells, corpus, backends, models, smp) for smp in resamples]
        if targets:
            out += [
                "",
                "| backend | target loss | compute multiplier vs vanilla | 95% bootstrap interval | paper |",
                "|---|---|---|---|---|",
            ]
        for b in backends:
            if b == "vanilla" or b not in base:
                continue
            for t in targets:
                mult = compute_at(base["vanilla"][0], t) / compute_at(base[b][0], t)
                bs = [compute_at(f["vanilla"][0], t) / compute_at(f[b][0], t) for f in boots if "vanilla" in f and b in f]
                bs = [x for x in bs if math.isfinite(x)]
                if len(seeds) < 2:
                    iv = "n/a (one seed: every resample is the same)"
                else:
                    iv = f"[{np.percentile(bs, 2.5):.3f}, {np.percentile(bs, 97.5):.3f}] ({len(bs)} fits)" if bs else "n/a"
                cv, cb = compute_at(base["vanilla"][0], t), compute_at(base[b][0], t)
                if not (math.isfinite(cv) and math.isfinite(cb)):
                    name, f = ("vanilla", base["vanilla"][0]) if not math.isfinite(cv) else (b, base[b][0])
                    why = "never reaches it" if t <= f[0] else f"is almost flat (alpha = {f[2]:.4f}): C beyond float range"
                    shown = f"undefined: {name}'s fit (E = {f[0]:.4f}) {why}"
                else:
                    shown = f"{mult:.3f}x"
                out.append(f"| {b} | {t:.4f} | {shown} | {iv} | {PAPER.get(b, '-')} |")
        ax.set_xscale("log")
        ax.set_xlabel("training FLOPs (analytic)")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"scaling fit: {corpus}")
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
    scal, sp = scaling_section(records, images, n_boot, np.random.default_rng(seed))
    out += scal
    if sp:
        plots.append(("Scaling fits", sp))
    out += ["## Plots", ""]
    for title, path in plots:
        rel = os.path.relpath(path, out_dir)
        out += [f"{title}:", "", f"![{title}]({Path(rel).as_posix()})", ""]
    out += ["## Summary", ""]
    if verdicts:
        by = defaultdict(list)
        for corpus, claim, v in verdicts:
            by[v.split(" (")[0]].append(f"{claim} ({corpus})")
        for v in ("holds", "does not hold", "inconclusive"):
            if by[v]:
                out.append(f"- **{v}**: " + "; ".join(by[v]) + ".")
    out.append("")
    return "\n".join(out)


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
