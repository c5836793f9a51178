"""Launchers and data-parallel layouts: ``scripts/launch_local.sh`` (ZeRO-2 DP=2, EP=2), two "nodes" through
the ``deepspeed`` launcher with ``--no_ssh`` on 127.0.0.1, and launcher-time config errors.

All data-parallel runs use DP=2 x micro 2 x grad_accum 1, the same samples per step as the single-process
baseline's micro 2 x grad_accum 2 (``_launch.py``), so they must reproduce its losses.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.distributed._launch import (
    COMMON,
    LAUNCH_LOCAL,
    REPO,
    TIMEOUT_S,
    assert_same_training,
    check,
    env,
    free_port,
    launch_local,
    metrics,
)

pytestmark = pytest.mark.distributed
DP2 = ["residual=msar", "parallel.grad_accum=1"]


def test_zero2_data_parallel_matches_single_process(runs, tmp_path):
    rows = launch_local(2, tmp_path / "dp_zero2", *DP2, "parallel=dp_zero2")
    assert_same_training(rows, runs.single("msar"))


def test_expert_parallel_training_matches_single_process(runs, tmp_path):
    """EP=2 over the 2 data-parallel ranks (ZeRO-2): each rank holds 4 of the 8 routed experts."""
    rows = launch_local(2, tmp_path / "ep2", *DP2, "parallel=ep2")
    assert_same_training(rows, runs.single("msar"))


def test_two_nodes_without_ssh(runs, tmp_path):
    """Two launcher processes, one per "node" of a 2-host hostfile (dummy names, never resolved), one rank
    each: ``deepspeed --no_ssh --node_rank N --master_addr 127.0.0.1``. Together: DP=2, ZeRO-0."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port = str(free_port())
    run_dir = tmp_path / "two_nodes"
    procs = []
    for node_rank in (0, 1):
        cmd = [
            *(sys.executable, "-m", "deepspeed.launcher.runner"),  # = the `deepspeed` console script
            *("--hostfile", str(hostfile), "--no_ssh", "--num_nodes", "2", "--num_gpus", "1"),
            *("--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", port),
            *("--module", "msar_train.train", *COMMON, *DP2, "parallel=single", f"trainer.run_dir={run_dir}"),
        ]
        procs.append(subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node_rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        check(subprocess.CompletedProcess(p.args, p.returncode, out, err), f"node {node_rank}")
        assert "dist_world_size=2" in out + err
    assert_same_training(metrics(run_dir), runs.single("msar"))


@pytest.mark.parametrize(
    "nproc,overrides,field",
    [
        (2, ["parallel=pp2_ep2"], "parallel.ep_size"),  # 2 ranks / 2 stages = DP 1, EP 2 does not divide it
        (3, ["parallel=pp2"], "parallel.pp_stages"),  # 3 ranks do not split into 2 stages
    ],
)
def test_world_dependent_errors_name_the_field(nproc, overrides, field):
    proc = subprocess.run(
        ["bash", str(LAUNCH_LOCAL), str(nproc), *COMMON, *overrides],
        env=env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode != 0
    assert f"msar-train: {field}=" in proc.stderr


@pytest.mark.parametrize("args", [[], ["two"], ["0"]])
def test_launch_local_usage(args):
    proc = subprocess.run(["bash", str(LAUNCH_LOCAL), *args], env=env(), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr
