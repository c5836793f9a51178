"""Console progress: a rich bar with ETA, loss, validation loss, tokens/s and skipped steps
(nothing when disabled; rich prints plain, non-animated output when stderr is not a terminal)."""

from __future__ import annotations

import math

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


def _fmt(v: float, spec: str) -> str:
    return format(v, spec) if math.isfinite(v) else str(v)


class Progress:
    """``with Progress(total, start=step) as bar: bar.update(step, metrics)``; ``start`` > 0 for a
    resumed run, so the bar and its ETA count only the steps still to run."""

    def __init__(self, total: int, enabled: bool = True, start: int = 0):
        self.total = total
        self.start = start
        self.enabled = enabled
        self.console = Console(stderr=True)
        self._bar = None
        self._task = None
        self._last: dict[str, str] = {}

    def __enter__(self) -> Progress:
        if self.enabled:
            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("val {task.fields[val]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[skipped]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total, completed=self.start, loss="-", val="-", tps="-", skipped="")
        return self

    def update(self, step: int, m: dict) -> None:
        if "val/loss" in m:
            self._last["val"] = _fmt(m["val/loss"], ".3f")
        if self._bar is not None:
            skipped = int(m.get("train/skipped_steps", 0))
            self._bar.update(
                self._task,
                completed=step,
                loss=_fmt(m["train/loss"], ".3f") if "train/loss" in m else "-",
                val=self._last.get("val", "-"),
                tps=_fmt(m["tokens_per_s"], ".0f"),
                skipped=f"skipped {skipped}" if skipped else "",
            )

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
