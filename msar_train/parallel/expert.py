"""Expert parallelism for the DeepSeekMoE layer: routed experts sharded over an EP group, dropless all-to-all.

Legend:
    N = local tokens (B*T on this rank), D = d_model, E = n_routed experts, K = top_k,
    R = ep_size (ranks of the expert-parallel group), L = E // R local experts per rank,
    M = N*K (token, slot) pairs this rank sends, Q = pairs this rank receives (for its L experts).

Layout. Rank ``r`` of the EP group holds the global experts ``[r*L, (r+1)*L)``. The router (weights and
``expert_bias``) and the shared experts stay replicated (plain data-parallel parameters).

Forward (``ExpertParallelMoE.forward``):
    1. The router runs on the local tokens exactly as in ``MoE.forward`` (selection on score+bias,
       mixing weights from the unbiased scores). Its aux loss and ``load_counts`` therefore cover only
       this rank's tokens: the aux loss is a per-rank loss (average it like the LM loss), and the
       ``load_counts`` are the full E-length counts of this rank's tokens, so the trainer all-reduces them
       over the data-parallel group and calls ``apply_bias_update`` identically on every rank.
    2. The M pairs are sorted by expert (hence by destination rank), the per-expert counts are exchanged
       with one ``all_to_all_single`` (E ints), then the token rows with a variable-split
       ``all_to_all_single`` (gloo supports uneven splits there; its list ``all_to_all`` does not).
    3. Every local expert runs once on all its rows (also on zero rows: every rank then builds the same
       graph and every expert parameter gets a gradient, so hook-driven gradient reductions stay in step).
    4. The results travel back with the reverse all-to-all and are combined with the routing weights by
       ``index_add`` (the same arithmetic as ``MoE.forward``), plus the shared experts.
    Both all-to-alls are differentiable (``_AllToAll``: backward is the reverse exchange). Every rank of
    the EP group must run each MoE layer's forward and backward in the same order.

DeepSpeed. The engine recognises MoE layers only as instances of ``deepspeed.moe.layer.MoE``; ZeRO-1/2
partitioning, the expert-data-parallel gradient all-reduce and the per-expert checkpoint files all hang on
that check and on DeepSpeed's native parameter names. So the local experts live in ``_ExpertShard``, a
parameter-only subclass of DeepSpeed's ``MoE`` (its gate/dispatch are never built), under DeepSpeed's names.
Parameter names (the only change ``shard_experts`` makes to names):

    single process:  experts.{g}.{w_gate,w_up,w_down}.weight                       g in [0, E)
    expert parallel: deepspeed_moe.experts.deepspeed_experts.{l}.{...}.weight      on EP rank g // L, l = g % L

``expert_name_map`` returns that mapping for a sharded module. DeepSpeed's MoE checkpoint writes one file
per global expert (``layer_{i}_expert_{g}_mp_rank_XX_model_states.pt``, i = MoE index inside the stage), so
the file layout does not depend on ep_size (reloading under another ep_size is untested).
Expert parameters carry ``allreduce = False`` and ``group_name = "ep_size_{R}"``: that is what
``deepspeed.moe.utils.is_moe_param`` and ``split_params_into_different_moe_groups_for_optimizer`` read.

Call order (engine side):
    deepspeed.init_distributed(dist_backend=..., timeout=...)
    eg = expert_groups_from_deepspeed(ep_size, pp_stages)     # collective: every rank, same order
    model = build_model(...)                               # same seed on all ranks; a PipelineModule under PP
    shard_model_experts(model, eg.ep_group, eg.ep_rank, eg.ep_size)   # only this stage's MoE layers
    params = split_params_into_different_moe_groups_for_optimizer({"params": [...], "name": "params"})
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, ...), config=...)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from torch import nn

from msar_train.model.ffn import SwiGLU
from msar_train.model.moe import MoE
from msar_train.model.recompute import recomputing

__all__ = [
    "ExpertGroups",
    "ExpertParallelMoE",
    "expert_group_name",
    "expert_groups_from_deepspeed",
    "expert_name_map",
    "shard_experts",
    "shard_model_experts",
]

# DeepSpeed's native MoE prefix; its checkpoint code matches r"\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)".
_DS_EXPERTS = "deepspeed_moe.experts.deepspeed_experts"


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's key for the EP / expert-data-parallel groups and the ``group_name`` of expert params."""
    return f"ep_size_{ep_size}"


# --------------------------------------------------------------------------------------------------
# Differentiable variable-split all-to-all
# --------------------------------------------------------------------------------------------------


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x[sum(in_splits[:r]) : ...]`` go to rank r; ``out_splits[r]`` rows arrive from rank r."""
    x = x.contiguous()
    y = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(y, x, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return y


class _AllToAll(torch.autograd.Function):
    """All-to-all whose backward is the reverse all-to-all (splits swapped).

    Written here rather than taken from ``torch.distributed.nn`` to own the contract: uneven and zero
    splits, any leading row count (also 0), and no hidden host syncs.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        return _exchange(grad_y, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


# --------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------


class _ExpertList(nn.Module):
    """Holds ``deepspeed_experts`` so the parameter names match DeepSpeed's native MoE."""

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(experts)


class _ExpertShard(DeepSpeedMoE):
    """This rank's routed experts, registered with the DeepSpeed engine as a native MoE layer.

    Only parameters and the attributes the engine reads (``num_experts``, ``num_local_experts``,
    ``ep_size``, ``expert_group_name``); ``DeepSpeedMoE.__init__`` is skipped on purpose because it builds
    the softmax top-k capacity gate we do not use. Never called: ``ExpertParallelMoE`` drives the experts.
    """

    def __init__(self, experts: Sequence[nn.Module], num_experts: int, ep_size: int, ep_group) -> None:
        nn.Module.__init__(self)
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = expert_group_name(ep_size)
        self.use_residual = False
        self.enable_expert_tensor_parallelism = False
        self.experts = _ExpertList(experts)
        self._ep_group = ep_group
        for p in self.parameters():
            # deepspeed.moe.utils.is_moe_param: allreduce False -> reduced over the expert-data-parallel
            # group named group_name instead of the whole data-parallel group.
            p.allreduce = False
            p.group_name = self.expert_group_name

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, **_: object) -> None:
        """Called by ``deepspeed.initialize`` on every module that has it: check, never create, the groups
        (creating them here would ignore the pipeline layout; see ``expert_groups_from_deepspeed``)."""
        from deepspeed.utils import groups

        name = self.expert_group_name
        if name not in groups._get_expert_parallel_group_dict():
            raise RuntimeError(
                f"DeepSpeed has no expert-parallel group {name!r}: call expert_groups_from_deepspeed({self.ep_size}) "
                "after deepspeed.init_distributed and before shard_experts / deepspeed.initialize"
            )
        if self._ep_group is not None:
            mine = dist.get_process_group_ranks(self._ep_group)
            theirs = list(groups._get_expert_parallel_group_ranks(name))
            if mine != theirs:
                raise RuntimeError(f"experts were sharded over ranks {mine} but DeepSpeed's {name!r} group is {theirs}")

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("_ExpertShard holds parameters only; ExpertParallelMoE.forward dispatches the tokens")


class ExpertParallelMoE(MoE):
    """``MoE`` after ``shard_experts``: same router, shared experts, buffers and outputs; the routed
    experts are this rank's slice ``deepspeed_moe.experts.deepspeed_experts`` and tokens travel by
    all-to-all over ``ep_group``. Instances are made by ``shard_experts`` only (class swap in place)."""

    ep_group: object
    ep_rank: int
    ep_size: int
    deepspeed_moe: _ExpertShard

    @property
    def local_experts(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    @property
    def local_expert_ids(self) -> range:
        L = self.cfg.n_routed // self.ep_size
        return range(self.ep_rank * L, (self.ep_rank + 1) * L)

    def forward(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x_BTD.shape
        N, K, E, R = B * T, self.cfg.top_k, self.cfg.n_routed, self.ep_size
        L = E // R
        x_ND = x_BTD.reshape(N, D)
        r = self.router(x_ND, seq_len=T)

        # Sorting by expert also sorts by destination rank (rank = expert // L): one contiguous slice each.
        expert_M = r.idx_NK.reshape(-1)
        order_M = torch.argsort(expert_M, stable=True)
        token_M = order_M // K
        counts_E = torch.bincount(expert_M, minlength=E)
        x_MD = x_ND[token_M]
        w_M = r.weight_NK.reshape(-1)[order_M]

        # recv[s][l]: rows source rank s sends to local expert l. One host sync for both split lists.
        recv_RL = _exchange(counts_E, [L] * R, [L] * R, self.ep_group) if R > 1 else counts_E
        sizes = torch.cat([counts_E.view(R, L).sum(dim=1), recv_RL]).tolist()
        send_R, recv = sizes[:R], [sizes[R + s * L : R + (s + 1) * L] for s in range(R)]
        recv_R = [sum(row) for row in recv]

        x_QD = _AllToAll.apply(x_MD, recv_R, send_R, self.ep_group) if R > 1 else x_MD
        # Received rows are ordered (source, local expert); each expert runs once on its rows of all sources.
        chunks = x_QD.split([c for row in recv for c in row])
        y_chunks: list[torch.Tensor | None] = [None] * (R * L)
        for l_idx, expert in enumerate(self.local_experts):
            y_SD = expert(torch.cat([chunks[s * L + l_idx] for s in range(R)]))
            for s, y in enumerate(y_SD.split([recv[s][l_idx] for s in range(R)])):
                y_chunks[s * L + l_idx] = y
        y_QD = torch.cat(y_chunks)  # back in the received (source, local expert) order
        y_MD = _AllToAll.apply(y_QD, send_R, recv_R, self.ep_group) if R > 1 else y_QD

        # From here on identical to MoE.forward.
        y_MD = (y_MD.to(w_M.dtype) * w_M[:, None]).to(x_ND.dtype)
        out_ND = torch.zeros_like(x_ND).index_add_(0, token_M, y_MD)
        if self.shared is not None:
            out_ND = out_ND + self.shared(x_ND).to(x_ND.dtype)

        load_E = counts_E.detach().to(torch.float32)
        self.last_load = load_E
        if self.training and not recomputing():  # an activation-checkpoint recompute is not a new forward
            self.load_counts += load_E.to(self.load_counts.dtype)
        return out_ND.view(B, T, D), r.aux_loss

    def extra_repr(self) -> str:
        return f"ep_rank={self.ep_rank}, ep_size={self.ep_size}, local_experts={list(self.local_expert_ids)}"


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def shard_experts(moe: MoE, ep_group, ep_rank: int, ep_size: int) -> None:
    """Convert a built single-process ``MoE`` in place into an ``ExpertParallelMoE``.

    Keeps the global experts ``[ep_rank*L, (ep_rank+1)*L)`` (``L = n_routed // ep_size``) and drops the
    others; build the model with the same seed on every rank first so replicated parameters agree and
    the shards together are the single-process model. ``ep_group`` is the torch process group of the EP
    ranks (its rank order = expert order); it is only used in forward, so ``None`` is allowed for a
    module that is inspected but never run. Idempotence is not supported: shard once.
    """
    if type(moe) is not MoE:
        raise TypeError(f"shard_experts expects a single-process MoE, got {type(moe).__name__}")
    E = moe.cfg.n_routed
    if ep_size < 1 or E % ep_size != 0:
        raise ValueError(f"parallel.ep_size={ep_size} must be >= 1 and divide model.moe.n_routed={E}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} must lie in [0, parallel.ep_size={ep_size})")
    if ep_group is not None and dist.is_initialized():
        g_size, g_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        if (g_size, g_rank) != (ep_size, ep_rank):
            raise ValueError(f"ep_group has size {g_size} and this rank is {g_rank} in it, but ep_size={ep_size}, ep_rank={ep_rank}")
    L = E // ep_size
    local: list[SwiGLU] = list(moe.experts[ep_rank * L : (ep_rank + 1) * L])
    del moe.experts  # the other ranks' experts are freed with the list
    moe.__class__ = ExpertParallelMoE
    moe.ep_group, moe.ep_rank, moe.ep_size = ep_group, ep_rank, ep_size
    moe.deepspeed_moe = _ExpertShard(local, E, ep_size, ep_group)


def shard_model_experts(model: nn.Module, ep_group, ep_rank: int, ep_size: int) -> int:
    """``shard_experts`` on every single-process ``MoE`` inside ``model``; returns how many were sharded."""
    moes = [m for m in model.modules() if type(m) is MoE]
    for m in moes:
        shard_experts(m, ep_group, ep_rank, ep_size)
    return len(moes)


def expert_name_map(moe: ExpertParallelMoE, prefix: str = "") -> dict[str, str]:
    """``{expert-parallel parameter name: single-process name}`` for this rank's experts.

    E.g. ``deepspeed_moe.experts.deepspeed_experts.1.w_up.weight`` -> ``experts.5.w_up.weight`` on EP rank 1
    of 2 with 8 experts. ``prefix`` is the module's own path (``"layers.3.ffn."``), prepended to both sides.
    """
    first = moe.local_expert_ids.start
    out = {}
    for name, _ in moe.deepspeed_moe.named_parameters(prefix="deepspeed_moe"):
        m = re.fullmatch(re.escape(_DS_EXPERTS) + r"\.(\d+)\.(.+)", name)
        assert m, name
        out[prefix + name] = f"{prefix}experts.{first + int(m.group(1))}.{m.group(2)}"
    return out


@dataclass(frozen=True)
class ExpertGroups:
    name: str  # "ep_size_{ep_size}": DeepSpeed's key and the expert params' group_name
    ep_size: int
    ep_group: object  # torch ProcessGroup: all-to-all between the ep_size ranks sharing one set of experts
    ep_rank: int  # this rank's index in ep_group = which expert slice it holds
    edp_group: object  # expert-data-parallel group: ranks holding the same experts (expert grads reduce here)
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]


def expert_groups_from_deepspeed(ep_size: int, pp_stages: int = 1, use_data_before_expert_parallel: bool = False) -> ExpertGroups:
    """Create (first call) or fetch DeepSpeed's expert-parallel and expert-data-parallel groups.

    Collective: every rank calls it, in the same order, after ``deepspeed.init_distributed`` and before
    ``deepspeed.initialize`` (the engine only looks the groups up, via ``_ExpertShard``). ``pp_stages`` is
    the number of pipeline stages: with DeepSpeed's pipe/data topology (global rank = stage * dp + dp_id)
    EP groups are then consecutive blocks of ``ep_size`` ranks inside each stage's data-parallel group and
    never span stages. ``ep_size`` must divide the data-parallel size ``world // pp_stages``.
    """
    from deepspeed.utils import groups

    if not dist.is_initialized():
        raise RuntimeError("expert_groups_from_deepspeed needs deepspeed.init_distributed() first")
    world = dist.get_world_size()
    if pp_stages < 1 or world % pp_stages != 0:
        raise ValueError(f"parallel.pp_stages={pp_stages} must divide the world size {world}")
    dp = world // pp_stages
    if ep_size < 1 or dp % ep_size != 0:
        raise ValueError(
            f"parallel.ep_size={ep_size} must divide the data-parallel size {dp} (= world {world} / parallel.pp_stages {pp_stages})"
        )
    name = expert_group_name(ep_size)
    groups._create_expert_and_data_parallel(ep_size, pp_size=pp_stages, use_data_before_expert_parallel_=use_data_before_expert_parallel)
    ep_group = groups._get_expert_parallel_group(name)
    return ExpertGroups(
        name=name,
        ep_size=ep_size,
        ep_group=ep_group,
        ep_rank=dist.get_rank(ep_group),
        edp_group=groups._get_expert_data_parallel_group(name),
        ep_ranks=tuple(groups._get_expert_parallel_group_ranks(name)),
        edp_ranks=tuple(groups._get_expert_data_parallel_group_ranks(name)),
    )
