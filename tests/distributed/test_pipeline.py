"""Pipeline parallelism against the single-process run, every backend: same losses and gradient norm for
3 optimizer steps (PP=2, ZeRO-1, 2 ranks); PP=2 x EP=2 on 4 ranks; activation checkpointing under PP.

Each run is a subprocess (``tests/distributed/_launch.py``); baselines and PP=2 runs are shared with
test_plan.py through the session ``runs`` cache.
"""

from __future__ import annotations

import pytest

from msar_train.config import compose_config
from tests.distributed._launch import BACKENDS, assert_same_training, launch_local

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
