"""Learning-rate schedules and parameter groups."""

import pytest
from omegaconf import OmegaConf

from msar_train.config.schema import TrainerConfig
from msar_train.parallel.optim import lr_factor, param_groups
from tests.unit.helpers import build, preset


def t(**kw):
    return OmegaConf.structured(TrainerConfig(**kw))


def test_warmup_then_cosine_to_floor():
    c = t(max_steps=100, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    f = [lr_factor(s, c) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[99] == pytest.approx(0.1, abs=1e-3)


def test_wsd_is_flat_then_decays():
    c = t(max_steps=100, warmup_steps=10, schedule="wsd", wsd_decay_fraction=0.2, min_lr_ratio=0.0)
    f = [lr_factor(s, c) for s in range(100)]
    assert all(x == 1.0 for x in f[10:80])
    assert f[80] < 1.0 and f[99] == pytest.approx(0.0)
    assert all(a > b for a, b in zip(f[80:], f[81:]))


def test_vectors_do_not_decay():
    m = build(preset("msar", n_blocks=4), n_layers=2)
    decay, no_decay = param_groups(m, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert no_decay["weight_decay"] == 0.0
