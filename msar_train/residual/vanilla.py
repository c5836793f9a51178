"""Plain PreNorm residual: ``h_{l+1} = h_l + f_l(h_l)``. State: ``(h_BTD,)``."""

from __future__ import annotations

import torch
from torch import nn

from msar_train.residual.base import Branch, ResidualBackend, ResidualSite, SeqContext, State, register


class _Identity(nn.Module):
    def forward(self, h_BTD: torch.Tensor) -> State:
        return (h_BTD,)


class _Exit(nn.Module):
    def forward(self, state: State, ctx: SeqContext) -> torch.Tensor:
        return state[0]


class VanillaSite(ResidualSite):
    def forward(self, state: State, branch: Branch, ctx: SeqContext) -> State:
        (h_BTD,) = state
        return (h_BTD + branch(h_BTD),)


@register
class VanillaBackend(ResidualBackend):
    name = "vanilla"

    def build_entry(self) -> nn.Module:
        return _Identity()

    def build_site(self, layer_idx: int, sublayer: int) -> ResidualSite:
        return VanillaSite()

    def build_exit(self) -> nn.Module:
        return _Exit()

    def state_shapes(self, after_layer: int, batch: int, seq: int) -> list[tuple[int, ...]]:
        return [(batch, seq, self.d_model)]

    def state_names(self, after_layer: int) -> list[str]:
        return ["h"]

    def site_activation_bytes(self, layer_idx: int, sublayer: int, batch: int, seq: int, elem: int) -> int:
        return elem * batch * seq * self.d_model  # h + f(h): the new hidden state

    def forward_flops_per_token(self) -> float:
        return float(self.n_branches * self.d_model)  # one add per branch
