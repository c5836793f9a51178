"""Pipeline parallelism against the single-process run, every backend: same losses and gradient norm for
3 optimizer steps (PP=2, ZeRO-1, 2 ranks); PP=2 x EP=2 on 4 ranks; activation checkpointing under PP.

Each run is a subprocess (``tests/distributed/_launch.py``); baselines and PP=2 runs are shared with
test_plan.py through the session ``runs`` cache.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from msar_train.config import compose_config
from tests.distributed._launch import BACKENDS, COMMON, REPO, TIMEOUT_S, assert_same_training, env, launch_local, single

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("backend", BACKENDS)
def test_pp2_matches_single_process(runs, backend):
    assert_same_training(runs.pipeline(backend), runs.single(backend))


def test_pp2_preset_is_zero1(monkeypatch):
    """So test_pp2_matches_single_process is also the ZeRO-1 + pipeline test."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = compose_config(["parallel=pp2"]).parallel
    assert (p.pp_stages, p.zero_stage) == (2, 1)


def test_pp2_ep2_on_4_ranks_matches_single_process(runs, tmp_path):
    """2 stages x 2 data-parallel ranks, experts sharded over each stage's 2 ranks. DP=2 x micro 2 x accum 1
    sees the same 4 samples per step as the baseline's micro 2 x accum 2 (``_launch.py``)."""
    rows = launch_local(4, tmp_path / "pp2_ep2", "residual=msar", "parallel=pp2_ep2", "parallel.grad_accum=1")
    assert_same_training(rows, runs.single("msar"))


def test_pp2_with_activation_checkpointing_matches_single_process(runs, tmp_path):
    rows = launch_local(2, tmp_path / "pp2_ckpt", "residual=msar", "parallel=pp2", "parallel.activation_checkpointing=true")
    assert_same_training(rows, runs.single("msar"))


def test_pp2_with_4_accumulation_steps_gives_the_single_process_gradients(runs, tmp_path):
    """The DeepSpeed floor (pyproject: deepspeed>=0.19.3): earlier releases scaled pipeline gradients by
    the accumulation steps once per stage. Micro 1 x accum 4 sees the baseline's 4 samples per step."""
    rows = launch_local(2, tmp_path / "pp2_acc4", "residual=msar", "parallel=pp2", "parallel.micro_batch_size=1", "parallel.grad_accum=4")
    assert_same_training(rows, runs.single("msar"))


def test_pp2_with_a_dense_only_first_stage(tmp_path):
    """model.first_k_dense=4 of 8 blocks: stage 0 (embedding + blocks 0-3) holds no MoE layer; router-bias
    updates, the load metrics and the aux loss still work and match the single process."""
    import json

    dense = ["residual=msar", "model.first_k_dense=4", "parallel.partition_method=uniform"]
    plan = subprocess.run(
        [sys.executable, "-m", "msar_train.parallel.plan", *COMMON, *dense, "parallel=pp2"],
        env=env(), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert json.loads(plan.stdout)["stages"][0]["layers"][1] <= 5  # embedding + blocks 0..3 at most: dense only
    ref = single(tmp_path / "single", *dense)
    rows = launch_local(2, tmp_path / "pp2", *dense, "parallel=pp2")
    assert_same_training(rows, ref)
    for a, b in zip(rows, ref, strict=True):
        assert a["moe/load_max_over_mean"] == pytest.approx(b["moe/load_max_over_mean"], rel=1e-5)
