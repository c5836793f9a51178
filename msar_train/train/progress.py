"""Console progress: a rich bar with ETA, loss and tokens/s (plain lines when disabled or not a TTY)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.total = total
        self.enabled = enabled
        self.console = Console(stderr=True)
        self._bar = None
        self._task = None
        self._last = {}

    def __enter__(self) -> Progress:
        if self.enabled:
            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("val {task.fields[val]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total, loss="-", val="-", tps="-")
        return self

    def update(self, step: int, m: dict) -> None:
        if "val/loss" in m:
            self._last["val"] = f"{m['val/loss']:.3f}"
        if self._bar is not None:
            self._bar.update(
                self._task, completed=step, loss=f"{m['train/loss']:.3f}", val=self._last.get("val", "-"), tps=f"{m['tokens_per_s']:.0f}"
            )

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
