"""Launching the training CLI in subprocesses for the distributed tests, and comparing their metrics.

Every run is the same tiny 3-step job (``COMMON``); runs differ only in their parallel layout. With
micro-batch 2 x grad_accum 2 on one rank (the baseline), a layout with data-parallel size DP must use
``grad_accum = 2 // DP`` to see the same samples per step: the loader gives rank r of w the samples
``perm[r::w]`` (``data/loader.py``), so DP=2 x micro 2 x accum 1 covers exactly the baseline's first four
samples of the permutation per step, only split differently over ranks and micro-batches.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from msar_train.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
LAUNCH_LOCAL = REPO / "scripts" / "launch_local.sh"
RECORDER = Path(__file__).with_name("_pipe_recorder.py")
BACKENDS = ["vanilla", "mhc", "attnres", "msar"]
COMMON = [
    "model=tiny",
    "data.seq_len=32",
    "parallel.micro_batch_size=2",
    "parallel.grad_accum=2",
    "trainer.max_steps=3",
    "trainer.log_every=1",
    "trainer.eval_every=3",
    "trainer.eval_batches=1",
    "trainer.progress=false",
    "logger.mode=disabled",
]
TIMEOUT_S = 300
# Set by an in-process run (engine.prepare_environment) of another test; a launcher must set its own.
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    out.update(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",  # ranks share 2 cores: more threads oversubscribe them (20-50x slower)
        GLOO_SOCKET_IFNAME="lo",
        WANDB_MODE="disabled",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    out.update(extra)
    return out


def check(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode == 0, f"{what} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def run(cmd: list[str], what: str, **extra_env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env(**extra_env), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    check(proc, what)
    return proc


def metrics(run_dir: Path) -> list[dict]:
    # Steps' training rows (other rows of a step, e.g. image paths, carry no loss).
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/total_loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    return rows


def single(run_dir: Path, *overrides: str) -> list[dict]:
    """One process, no launcher (the engine makes a world of one)."""
    run([sys.executable, "-m", "msar_train.train", *COMMON, *overrides, f"trainer.run_dir={run_dir}"], f"single {overrides}")
    return metrics(run_dir)


def launch_local(nproc: int, run_dir: Path, *overrides: str) -> list[dict]:
    """``scripts/launch_local.sh NPROC overrides`` (torch.distributed.run over gloo on loopback)."""
    run(["bash", str(LAUNCH_LOCAL), str(nproc), *COMMON, *overrides, f"trainer.run_dir={run_dir}"], f"launch_local {nproc} {overrides}")
    return metrics(run_dir)


def torchrun_cmd(nproc: int, script: Path, *args: str) -> list[str]:
    """``torch.distributed.run`` of ``script`` with ``nproc`` local ranks on 127.0.0.1 and a free port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1"]
    return [*cmd, "--master_port", str(free_port()), str(script), *args]


def run_worker(worker: Path, mode: str, out: Path, nproc: int = 2) -> dict[int, dict]:
    """Run a test worker script (``worker mode out``) on ``nproc`` ranks; each rank writes
    ``out/{mode}_rank{r}.json``, returned by rank."""
    run(torchrun_cmd(nproc, worker, mode, str(out)), f"{worker.name} {mode}")
    return {r: json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(nproc)}


def recorded_pipeline(nproc: int, run_dir: Path, *overrides: str) -> list[dict]:
    """Like ``launch_local`` but through ``_pipe_recorder.py``: each rank also writes what its pipeline
    engine sent / received as activations to ``run_dir/p2p/rank{r}.json``."""
    cmd = torchrun_cmd(nproc, RECORDER, str(run_dir / "p2p"), *COMMON, *overrides, f"trainer.run_dir={run_dir}")
    run(cmd, f"recorded pipeline {overrides}")
    return metrics(run_dir)


def assert_same_training(rows: list[dict], ref: list[dict], loss_rel: float = 1e-5, grad_rel: float = 1e-4) -> None:
    for a, b in zip(rows, ref, strict=True):
        for key in ("train/total_loss", "train/loss"):
            assert a[key] == pytest.approx(b[key], rel=loss_rel), (a["step"], key, a[key], b[key])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=grad_rel), (a["step"], a["grad_norm"], b["grad_norm"])


class RunCache:
    """Session-wide memo: each distinct run happens once however many tests read it."""

    def __init__(self, root: Path):
        self.root = root
        self._done: dict[tuple, object] = {}

    def get(self, key: tuple, make):
        if key not in self._done:
            self._done[key] = make(self.root / "-".join(str(k) for k in key))
        return self._done[key]

    def single(self, backend: str) -> list[dict]:
        return self.get(("single", backend), lambda d: single(d, f"residual={backend}"))

    def pipeline(self, backend: str) -> list[dict]:
        return self.get(("pp2", backend), lambda d: recorded_pipeline(2, d, f"residual={backend}", "parallel=pp2"))

    def pipeline_dir(self, backend: str) -> Path:
        self.pipeline(backend)
        return self.root / f"pp2-{backend}"
