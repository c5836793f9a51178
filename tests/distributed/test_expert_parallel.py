"""Expert parallelism (msar_train.parallel.expert): parity with the single-process MoE on 2 gloo ranks,
DeepSpeed engine integration (ZeRO-0/1/2 updates, MoE param groups, per-expert checkpoints), and the
single-process contract (validation, parameter marking, name mapping).

The multi-rank parts run tests/distributed/_ep_worker.py under torchrun once per mode (module fixtures)
and assert on the JSON each rank writes. Legend: E routed experts, R = ep_size = 2 ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from msar_train.config.schema import MoEConfig
from msar_train.model.moe import MoE
from tests.distributed._launch import run_worker

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_ep_worker.py")
TOL = 1e-5
PARITY_CASES = ["softmax_grouped", "sigmoid_grouped", "uneven", "empty_rank"]


@pytest.fixture(scope="module")
def parity(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    return run_worker(WORKER, "parity", tmp_path_factory.mktemp("ep_parity"))


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    return run_worker(WORKER, "deepspeed", tmp_path_factory.mktemp("ep_deepspeed"))


# ------------------------------------------------------------------------------------------------
# 2 ranks, ep_size 2, plain torch.distributed (gloo)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", PARITY_CASES)
def test_outputs_and_grads_match_single_process(parity: dict[int, dict], case: str) -> None:
    """Outputs, per-rank aux loss, input grads, summed router/shared grads and expert grads equal the
    single-process MoE run on the concatenated tokens."""
    for rank, res in parity.items():
        r = res[case]
        for key in ("out", "aux", "x_grad", "replicated_grad", "expert_grad"):
            assert r[key] < TOL, f"rank {rank} {case}: {key} differs by {r[key]}"


@pytest.mark.parametrize("case", PARITY_CASES)
def test_load_counts_are_this_ranks_global_counts(parity: dict[int, dict], case: str) -> None:
    """load_counts: the E-length counts of the rank's own tokens; all-reduced they drive an identical bias update."""
    for rank, res in parity.items():
        assert res[case]["load_counts"] == 0.0, f"rank {rank} {case}"
        assert res[case]["bias"] == 0.0, f"rank {rank} {case}"


def test_uneven_cases_are_really_uneven(parity: dict[int, dict]) -> None:
    c0, c1 = parity[0]["uneven"]["load_counts_list"], parity[1]["uneven"]["load_counts_list"]
    assert sum(c0[4:]) == 0 and sum(c0[:4]) > 0, "rank 0 must send nothing to rank 1"
    assert sum(c1[4:]) > 0 and sum(c1[:4]) > 0, "rank 1 must send to both ranks"
    assert c0[3] == c1[3] == 0 and c0[7] == c1[7] == 0, "experts 3 and 7 must receive no token"
    assert sum(parity[1]["empty_rank"]["load_counts_list"]) == 0, "rank 1 must have no tokens"
    assert sum(parity[0]["empty_rank"]["load_counts_list"][2:]) > 0, "rank 0 must send to rank 1"


def test_each_rank_holds_its_expert_slice(parity: dict[int, dict]) -> None:
    for rank in (0, 1):
        ids = {int(n.split(".")[1]) for n in parity[rank]["softmax_grouped"]["expert_names"]}
        assert ids == set(range(4 * rank, 4 * rank + 4))


# ------------------------------------------------------------------------------------------------
# 2 ranks under the DeepSpeed engine
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_deepspeed_engine_updates_match_single_process(ds: dict[int, dict], stage: int) -> None:
    """Two SGD steps through deepspeed.initialize (expert grads reduced over the expert-data-parallel
    group, ZeRO partitions expert params there) equal the single-process model on the DP-mean loss."""
    for rank, res in ds.items():
        r = res[f"zero{stage}"]
        assert r["has_moe_layers"], "the engine must see the sharded layer as a DeepSpeed MoE layer"
        assert r["moe_groups"] == 1
        assert r["dense_param"] < TOL and r["expert_param"] < TOL, f"rank {rank} zero{stage}: {r}"


def test_deepspeed_checkpoint_round_trip(ds: dict[int, dict]) -> None:
    for rank, res in ds.items():
        r = res["zero1"]
        assert r["moved"] > 0, "training must have changed every parameter tensor"
        assert r["reload"] == 0.0, f"rank {rank}: reloaded params differ by {r['reload']}"
    r0 = ds[0]["zero1"]
    # One file per *global* expert: the checkpoint does not depend on ep_size.
    assert r0["expert_files"] == [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(8)]
    assert "moe.router.expert_bias" in r0["main_keys"] and "moe.shared.w_up.weight" in r0["main_keys"]
    assert not [k for k in r0["main_keys"] if "deepspeed_experts" in k]


# ------------------------------------------------------------------------------------------------
# Single process: validation, marking, names (no process group needed)
# ------------------------------------------------------------------------------------------------


def _moe(**kw: object) -> MoE:
    base = {"n_routed": 8, "n_shared": 1, "top_k": 2, "expert_hidden": 6, "n_group": 2, "topk_group": 1}
    base.update(kw)
    torch.manual_seed(0)
    return MoE(MoEConfig(**base), 8)  # type: ignore[arg-type]


def test_ep_size_must_divide_n_routed() -> None:
    from msar_train.parallel.expert import shard_experts

    with pytest.raises(ValueError, match=r"parallel\.ep_size=3 .*model\.moe\.n_routed=8"):
        shard_experts(_moe(), None, 0, 3)
    with pytest.raises(ValueError, match="ep_rank"):
        shard_experts(_moe(), None, 2, 2)
    moe = _moe()
    shard_experts(moe, None, 0, 2)
    with pytest.raises(TypeError):
        shard_experts(moe, None, 0, 2)


def test_expert_params_are_marked_and_split_into_a_moe_group() -> None:
    from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

    from msar_train.parallel.expert import expert_name_map, shard_experts

    moe = _moe()
    shard_experts(moe, None, 1, 2)
    expert = {n for n, p in moe.named_parameters() if is_moe_param(p)}
    assert expert == {n for n, _ in moe.named_parameters() if n.startswith("deepspeed_moe.experts.deepspeed_experts.")}
    assert len(expert) == 4 * 3  # 4 local experts x (w_gate, w_up, w_down)
    for n, p in moe.named_parameters():
        if n in expert:
            assert p.allreduce is False and p.group_name == "ep_size_2"
        else:
            assert not hasattr(p, "allreduce") and not hasattr(p, "group_name"), n
    assert {n.split(".")[0] for n in moe.state_dict()} == {"router", "shared", "deepspeed_moe"}

    params = dict(moe.named_parameters())
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(params.values()), "name": "p"})
    assert [(g["name"], bool(g.get("moe"))) for g in groups] == [("p", False), ("ep_size_2", True)]
    assert {id(p) for p in groups[1]["params"]} == {id(params[n]) for n in expert}

    names = expert_name_map(moe, prefix="ffn.")
    assert names["ffn.deepspeed_moe.experts.deepspeed_experts.1.w_up.weight"] == "ffn.experts.5.w_up.weight"
    assert sorted({int(v.split(".")[2]) for v in names.values()}) == [4, 5, 6, 7]


def test_sharded_weights_are_the_single_process_weights() -> None:
    from msar_train.parallel.expert import expert_name_map, shard_experts

    full = _moe().state_dict()
    for rank in (0, 1):
        moe = _moe()
        shard_experts(moe, None, rank, 2)
        sd = moe.state_dict()
        for ep_name, sp_name in expert_name_map(moe).items():
            assert torch.equal(sd[ep_name], full[sp_name])
        assert torch.equal(sd["router.weight"], full["router.weight"])


def test_ep_size_one_matches_single_process() -> None:
    """ep_size 1 needs no communication: the dispatch itself must reproduce MoE.forward exactly."""
    from msar_train.parallel.expert import shard_experts

    ref, moe = _moe(score_func="sigmoid"), _moe(score_func="sigmoid")
    shard_experts(moe, None, 0, 1)
    x = torch.randn(3, 5, 8)
    xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    (yr, ar), (ye, ae) = ref(xr), moe(xe)
    g = torch.randn_like(yr)
    ((yr * g).sum() + ar).backward()
    ((ye * g).sum() + ae).backward()
    torch.testing.assert_close(ye, yr, rtol=0, atol=TOL)
    torch.testing.assert_close(xe.grad, xr.grad, rtol=0, atol=TOL)
    torch.testing.assert_close(moe.load_counts, ref.load_counts)
    torch.testing.assert_close(moe.router.weight.grad, ref.router.weight.grad, rtol=0, atol=TOL)
