"""The ``parallel`` group: presets compose, and each bad layout fails at compose time naming the field
(the world-size checks run when the launcher's WORLD_SIZE is known, and again when the engine starts)."""

from __future__ import annotations

import pytest

from msar_train.config import compose_config
from msar_train.train.cli import main as train_main
from tests.unit.helpers import CONFIGS

PRESETS = sorted(p.stem for p in (CONFIGS / "parallel").glob("*.yaml"))
WORLD = {"single": 1, "dp_zero2": 2, "ep2": 2, "pp2": 2, "pp2_ep2": 4}


@pytest.fixture(autouse=True)
def _no_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("name", PRESETS)
def test_every_parallel_preset_composes_for_its_world(monkeypatch, name):
    compose_config([f"parallel={name}"])
    monkeypatch.setenv("WORLD_SIZE", str(WORLD[name]))
    p = compose_config([f"parallel={name}"]).parallel
    assert WORLD[name] % p.pp_stages == 0 and (WORLD[name] // p.pp_stages) % p.ep_size == 0


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["parallel.pp_stages=9"], "parallel.pp_stages"),  # tiny has 8 blocks
        (["parallel.pp_stages=0"], "parallel.pp_stages"),
        (["parallel=pp2", "parallel.zero_stage=2"], "parallel.zero_stage"),
        (["parallel.zero_stage=3"], "parallel.zero_stage"),
        (["parallel.ep_size=3"], "parallel.ep_size"),  # does not divide tiny's 8 routed experts
        (["parallel.ep_size=2", "model.first_k_dense=8"], "parallel.ep_size"),  # no MoE layer at all
        (["parallel=pp2", "model.tie_embeddings=true"], "model.tie_embeddings"),
        (["parallel.micro_batch_size=0"], "parallel.micro_batch_size"),
        (["parallel.grad_accum=0"], "parallel.grad_accum"),
        (["parallel.dtype=float16"], "parallel.dtype"),
        (["parallel.partition_method=random"], "parallel.partition_method"),
        (["parallel.dist_backend=mpi"], "parallel.dist_backend"),
        (["+parallel.deepspeed_overrides.train_micro_batch_size_per_gpu=4"], "parallel.deepspeed_overrides.train_micro_batch_size_per_gpu"),
        (["+parallel.deepspeed_overrides.gradient_accumulation_steps=3"], "parallel.deepspeed_overrides.gradient_accumulation_steps"),
        (["parallel.grad_accum=2", "+parallel.deepspeed_overrides.train_batch_size=20"], "parallel.deepspeed_overrides.train_batch_size"),
        (["+parallel.bogus=1"], "parallel.bogus"),
    ],
)
def test_bad_parallel_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + "[=:]"):
        compose_config(["parallel.micro_batch_size=8", *overrides])


@pytest.mark.parametrize(
    "world,overrides,field",
    [
        (3, ["parallel=pp2"], "parallel.pp_stages"),  # 3 ranks do not split into 2 stages
        (2, ["parallel=pp2_ep2"], "parallel.ep_size"),  # data-parallel size 1 per stage
        (4, ["parallel.ep_size=8"], "parallel.ep_size"),  # 8 does not divide the data-parallel size 4
        (
            2,
            ["parallel.micro_batch_size=2", "+parallel.deepspeed_overrides.train_batch_size=8"],
            "parallel.deepspeed_overrides.train_batch_size",
        ),
    ],
)
def test_world_size_checks_at_compose(monkeypatch, world, overrides, field):
    compose_config(overrides)  # fine while the world is unknown
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ValueError, match=field.replace(".", r"\.") + "[=:]"):
        compose_config(overrides)


def test_train_batch_size_that_agrees_is_accepted(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = compose_config(
        ["parallel=pp2", "parallel.micro_batch_size=2", "parallel.grad_accum=3", "+parallel.deepspeed_overrides.train_batch_size=12"]
    )
    assert cfg.parallel.deepspeed_overrides.train_batch_size == 12


def test_cli_exits_2_on_a_bad_parallel_config(capsys, tmp_path):
    assert train_main(["parallel=pp2", "parallel.zero_stage=2", f"trainer.run_dir={tmp_path}/x"]) == 2
    assert "parallel.zero_stage=2" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("residual", ["msar", "attnres", "vanilla"])
def test_compose_time_layout_check_agrees_with_the_partitioner(residual):
    """One check (``validate_pipeline_layout``) refuses exactly the layouts the partitioner cannot cut,
    so a layout ``msar-plan`` refuses never reaches a launched run (``pp_stages=4 residual.n_blocks=1``)."""
    from msar_train.errors import ConfigError
    from msar_train.parallel.partition import partition

    seen = set()
    for n_blocks in (1, 2, 3, 8) if residual != "vanilla" else (None,):
        for P, V in ((2, 1), (3, 1), (4, 1), (2, 2), (2, 3), (4, 2)):
            for method in ("blocks", "uniform"):
                ov = [f"residual={residual}", f"parallel.pp_stages={P}", f"parallel.virtual_stages={V}"]
                ov += [f"parallel.partition_method={method}"]
                ov += [] if n_blocks is None else [f"residual.n_blocks={n_blocks}"]
                try:
                    cfg = compose_config(ov)
                    composed = True
                except ConfigError as e:
                    composed = False
                    assert str(e).startswith(("parallel.pp_stages=", "parallel.virtual_stages=")), e
                    cfg = compose_config([o for o in ov if "stages" not in o])
                try:
                    partition(cfg.model, cfg.residual, P * V, method)
                    cut = True
                except ValueError:
                    cut = False
                assert composed == cut, (ov, composed, cut)
                seen.add(composed)
    assert seen == {True, False} or residual == "vanilla"
