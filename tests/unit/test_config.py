"""Composition, typed schemas and cross-field validation: bad input names the field."""

import json

import pytest

from msar_train.config import compose_config
from msar_train.train.params import count_params
from msar_train.train.params import main as params_main
from tests.unit.helpers import CONFIGS, RESIDUAL_PRESETS


@pytest.mark.parametrize("name", RESIDUAL_PRESETS)
def test_every_residual_preset_composes(name):
    cfg = compose_config([f"residual={name}"])
    assert cfg.residual.name in {"vanilla", "mhc", "attnres", "msar"}


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml")))
def test_every_model_preset_composes(name):
    assert compose_config([f"model={name}"]).model.name == name


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["model.d_model=abc"], "model.d_model"),
        (["+model.bogus=1"], "model.bogus"),
        (["model.moe.wat=2"], "model.moe.wat"),
        (["+trainer.nope=1"], "trainer.nope"),
        (["residual.n_blocks=17"], "residual.n_blocks"),  # tiny has 16 branches
        (["model.moe.top_k=9"], "model.moe.top_k"),  # tiny has 8 routed experts
        (["model.moe.n_group=3"], "model.moe.n_group"),
        (["model.moe.n_group=4", "model.moe.topk_group=5"], "model.moe.topk_group"),
        (["model.moe.score_func=relu"], "model.moe.score_func"),
        (["residual.kernel_sizes=[4,8]"], "residual.kernel_sizes"),
        (["residual.fusion=max"], "residual.fusion"),
        (["residual.expansion=fft"], "residual.expansion"),
        (["model.n_kv_heads=3"], "model.n_kv_heads"),
        (["model.first_k_dense=9"], "model.first_k_dense"),
        (["trainer.schedule=step"], "trainer.schedule"),
        (["trainer.lr=-1"], "trainer.lr"),
        (["data.seq_len=1024"], "data.seq_len"),
        (["logger.mode=cloud"], "logger.mode"),
    ],
)
def test_bad_config_fails_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        compose_config(overrides)


def test_cli_reports_bad_config(capsys):
    assert params_main(["model.moe.top_k=99"]) == 2
    assert "model.moe.top_k" in capsys.readouterr().err


@pytest.mark.parametrize("name,target", [("moe_10b", 10e9), ("moe_18b", 18e9), ("moe_28b", 28e9)])
@pytest.mark.parametrize("residual", ["msar", "vanilla"])
def test_large_presets_are_within_5_percent(name, target, residual):
    n = count_params(compose_config([f"model={name}", f"residual={residual}"]))
    assert abs(n["total_params"] - target) / target < 0.05
    assert n["active_params"] < n["total_params"] / 3  # fine-grained MoE: a small active fraction


def test_params_cli_prints_one_json_line(capsys):
    assert params_main(["model=tiny"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    d = json.loads(out[0])
    assert d["total_params"] > d["active_params"] > 0


def test_param_count_matches_materialised_model():
    import torch

    from msar_train.model.transformer import Transformer

    cfg = compose_config(["model=tiny", "residual=msar"])
    m = Transformer(cfg.model, cfg.residual)
    assert count_params(cfg)["total_params"] == sum(p.numel() for p in m.parameters())
    moe = m.moe_layers()[0]
    expert = sum(p.numel() for p in moe.experts[0].parameters())
    unused = len(m.moe_layers()) * (cfg.model.moe.n_routed - cfg.model.moe.top_k) * expert
    assert count_params(cfg)["active_params"] == sum(p.numel() for p in m.parameters()) - unused
    assert torch.is_tensor(next(m.parameters()))
