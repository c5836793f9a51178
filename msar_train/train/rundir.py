"""Run-dir hygiene: one job per run dir (a lock), a resume only into the same model, no mixed metrics.

Rank 0 does all of this, in this order, before anything else is written to the run dir:

1. ``RunLock``: ``RUN_DIR/.lock`` holds ``{host, pid, started}`` of the job that owns the dir. A second
   job refuses to start (exit 2) naming that host and pid. A lock left by a dead process is taken over
   with a warning: on this host when its pid no longer runs; from another host (a requeued SLURM job
   on a new node) when its heartbeat (the file's mtime, touched every step) is older than
   ``STALE_OTHER_HOST_S``.
2. ``model_differences``: the checkpoint chosen by ``trainer.resume`` was written by a run whose config
   changes the model in no field (``model.*``, ``residual.*`` but ``residual.kernel``, the tokenizer);
   else one line per differing field and the resume is refused before any weight is loaded.
3. ``set_aside_metrics``: a fresh start (no checkpoint to continue) in a run dir that already holds a
   ``metrics.jsonl`` keeps that file as ``metrics.jsonl.<k>`` (the next free k) and starts a new one, so
   step numbers never repeat within a file. ``trainer.resume=none`` in a run dir that holds
   checkpoints is refused (saving would mix two runs' checkpoints and a later ``auto`` would pick the
   wrong one).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from msar_train.errors import InputError

LOCK = ".lock"
STALE_OTHER_HOST_S = 900.0
# Fields of the model-defining groups that may differ on resume: they change how the model is
# computed, not what (docs/decisions.md "Checkpoints").
MAY_DIFFER = {"residual.kernel"}
MODEL_GROUPS = ("model", "residual")


class RunDirBusy(InputError):
    """Another live job holds the run dir's lock (transient: a sweep does not record it as a failure)."""


def _warn(msg: str) -> None:
    print(f"msar-train: warning: {msg}", file=sys.stderr, flush=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


class RunLock:
    """``RUN_DIR/.lock`` for the lifetime of a job (rank 0). ``acquire`` raises ``InputError`` when a
    live job holds it; ``release`` removes it when it is still ours; ``touch`` is the heartbeat."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.held = False

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: a lock of unknown owner

    def _stale(self, other: dict[str, Any]) -> str | None:
        """Why ``other``'s lock may be taken over, or None when its job may still run."""
        host, pid = other.get("host"), other.get("pid")
        if host == self.mine["host"] and isinstance(pid, int):
            if pid == self.mine["pid"]:
                return "left by this process"
            return None if _pid_alive(pid) else f"process {pid} is gone"
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "it disappeared"
        return f"no heartbeat for {age:.0f} s" if age > STALE_OTHER_HOST_S else None

    def acquire(self) -> None:
        text = json.dumps(self.mine)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = self._read()
                if other is None:
                    continue  # released meanwhile
                why = self._stale(other)
                if why is None:
                    raise RunDirBusy(
                        f"trainer.run_dir={self.path.parent} is in use by pid {other.get('pid')} on host "
                        f"{other.get('host')} (since {other.get('started')}, lock file {self.path}); wait for that job, "
                        "use another trainer.run_dir, or delete the lock file if that job is gone"
                    ) from None
                _warn(f"taking over the stale lock {self.path} of pid {other.get('pid')} on {other.get('host')} ({why})")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            self.held = True
            return
        raise InputError(f"trainer.run_dir={self.path.parent}: could not take the lock {self.path} (another job keeps taking it)")

    def touch(self) -> None:
        if self.held:
            try:
                os.utime(self.path)
            except OSError:
                pass  # a heartbeat is advisory; a full or read-only disk shows up where files are written

    def release(self) -> None:
        if self.held and self._read() == self.mine:
            self.path.unlink(missing_ok=True)
        self.held = False


def _flatten(node: Any, prefix: str) -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}"))
        return out
    return {prefix: node}


def model_differences(saved: dict[str, Any], current: dict[str, Any], saved_tokenizer: str | None, tokenizer: str | None) -> list[str]:
    """``field: checkpoint A, this run B`` for every model-defining field that differs between the
    resolved config of a checkpoint (``saved``) and this run's (``current``), and for the tokenizer
    (sha256 of ``tokenizer.json``, when both are known)."""
    a = {k: v for g in MODEL_GROUPS for k, v in _flatten(saved.get(g, {}), g).items()}
    b = {k: v for g in MODEL_GROUPS for k, v in _flatten(current.get(g, {}), g).items()}
    lines = []
    for key in sorted(set(a) | set(b)):
        if key in MAY_DIFFER:
            continue
        va, vb = a.get(key, "(absent)"), b.get(key, "(absent)")
        if va != vb:
            lines.append(f"{key}: checkpoint {va}, this run {vb}")
    if saved_tokenizer and tokenizer and saved_tokenizer != tokenizer:
        lines.append(f"tokenizer (sha256 of tokenizer.json): checkpoint {saved_tokenizer[:12]}…, this run {tokenizer[:12]}…")
    return lines


def set_aside_metrics(run_dir: Path) -> Path | None:
    """A fresh start: move an existing ``metrics.jsonl`` to ``metrics.jsonl.<k>``; returns the new name."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file() or path.stat().st_size == 0:
        return None
    k = 1
    while (old := path.with_name(f"{path.name}.{k}")).exists():
        k += 1
    os.replace(path, old)
    _warn(f"fresh start in {run_dir}, which already holds metrics: the old {path.name} is kept as {old.name}")
    return old


__all__ = ["MAY_DIFFER", "RunDirBusy", "RunLock", "STALE_OTHER_HOST_S", "model_differences", "set_aside_metrics"]
