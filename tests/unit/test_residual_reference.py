"""Every backend's model forward against the explicit-loop references of the spec."""

import pytest
import torch

from msar_train.residual.base import SeqContext
from tests.unit.helpers import build, ids, perturb_residual, preset
from tests.unit.residual_reference import ref_depth_forward, ref_mhc_forward, ref_vanilla_forward


def test_vanilla_matches_reference():
    m = build(preset("vanilla"), n_layers=2)
    x = ids(seq=8)
    torch.testing.assert_close(m(x)[0], ref_vanilla_forward(m, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "res",
    [
        dict(name="attnres", n_blocks=3),
        dict(name="attnres", n_blocks=None),
        dict(name="msar", n_blocks=3),
        dict(name="msar", n_blocks=None),
        dict(name="msar", n_blocks=2, fusion="mean"),
        dict(name="msar", n_blocks=3, expansion="none"),
        dict(name="msar", n_blocks=3, num_streams=2, kernel_sizes=[3]),
    ],
)
def test_depth_backends_match_reference(res):
    from msar_train.config.schema import ResidualConfig

    m = build(ResidualConfig(**res), n_layers=3)
    perturb_residual(m)
    x = ids(batch=1, seq=7)
    torch.testing.assert_close(m(x)[0], ref_depth_forward(m, x), rtol=1e-9, atol=1e-9)


def test_msar_document_mask_matches_reference():
    from msar_train.config.schema import ResidualConfig

    m = build(ResidualConfig(name="msar", n_blocks=2, kernel_sizes=[2, 3, 5]), n_layers=2, document_mask=True)
    perturb_residual(m)
    x = ids(batch=2, seq=9)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1]])
    pos = torch.stack([torch.tensor([0, 1, 2, 0, 1, 2, 3, 0, 1]), torch.tensor([0, 0, 1, 2, 3, 4, 5, 6, 7])])
    torch.testing.assert_close(m(x, doc, pos)[0], ref_depth_forward(m, x, doc, pos), rtol=1e-9, atol=1e-9)


def test_mhc_matches_reference():
    m = build(preset("mhc", mhc_streams=3), n_layers=2)
    perturb_residual(m, scale=0.3)
    x = ids(batch=1, seq=4)
    torch.testing.assert_close(m(x)[0], ref_mhc_forward(m, x), rtol=1e-8, atol=1e-8)


def test_site_contract_returns_state_tuple():
    m = build(preset("msar", n_blocks=3), n_layers=3)
    carry = m.embed(ids())
    for blk in m.blocks:
        carry = blk(carry)
        assert isinstance(carry, tuple) and all(isinstance(t, torch.Tensor) for t in carry)
    assert SeqContext().doc_ids_BT is None
