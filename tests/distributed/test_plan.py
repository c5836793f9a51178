"""``msar-plan`` / ``plan(cfg)``: stage ranges, parameter counts and the tensors crossing each pipeline boundary.

Checked three ways: against the carry the single-process fold of ``Transformer.layers()`` really produces
at each cut (in process, every backend, with and without document masking); against what rank 0's
pipeline engine really put on the wire and rank 1 received in a 2-rank PP run (``_pipe_recorder.py``, the
runs test_pipeline.py also compares); and for the issue's byte relations (msar == attnres, mhc == n x vanilla).
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from msar_train.config import compose_config
from msar_train.model.transformer import Transformer
from msar_train.parallel.plan import main as plan_main
from msar_train.parallel.plan import plan
from msar_train.train.params import count_params
from tests.distributed._launch import BACKENDS, COMMON

TINY = ["model=tiny", "data.seq_len=32", "parallel.micro_batch_size=2"]


@pytest.fixture(autouse=True)
def _no_launcher_world(monkeypatch):
    # An in-process training test leaves WORLD_SIZE=1 behind, which compose would check pp_stages against.
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _cfg(*overrides: str):
    return compose_config([*TINY, *overrides])


def _shapes(tensors: list[dict]) -> list[tuple[list[int], str]]:
    return [(t["shape"], t["dtype"]) for t in tensors]


@torch.no_grad()
def _carries(cfg) -> list[list[tuple[list[int], str]]]:
    """(shape, dtype) of the carry after every layer but the head, from a real single-process forward."""
    model = Transformer(cfg.model, cfg.residual, document_mask=cfg.data.document_mask, seed=0)
    B, T = cfg.parallel.micro_batch_size, cfg.data.seq_len
    ids_BT = torch.randint(0, cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    x = (ids_BT, torch.zeros_like(ids_BT), torch.arange(T).expand(B, T)) if cfg.data.document_mask else ids_BT
    out = []
    for layer in model.layers()[:-1]:
        x = layer(x)
        out.append([(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in x])
    return out


@pytest.mark.parametrize("document_mask", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_boundaries_match_the_layer_fold(backend, document_mask):
    """pp_stages=4 on tiny's 8 blocks: 3 cuts (uniform partition: cuts anywhere)."""
    cfg = _cfg(f"residual={backend}", "parallel.pp_stages=4", "parallel.partition_method=uniform", f"data.document_mask={document_mask}")
    p = plan(cfg)
    carries = _carries(cfg)
    starts = [s["layers"][0] for s in p["stages"]]
    assert starts[0] == 0 and p["stages"][-1]["layers"][1] == 10 and len(starts) == 4
    assert [b["after_layer"] for b in p["boundaries"]] == [c - 1 for c in starts[1:]]
    for b in p["boundaries"]:
        assert _shapes(b["tensors"]) == carries[b["after_layer"]], b["after_layer"]
        names = [t["name"] for t in b["tensors"]]
        assert names[: 3 if document_mask else 1] == (["aux", "doc_ids", "positions"] if document_mask else ["aux"])
        assert b["bytes_per_microbatch"] == sum(
            4 * max(1, torch.Size(s).numel()) if d == "float32" else 8 * torch.Size(s).numel() for s, d in _shapes(b["tensors"])
        )


def test_msar_and_attnres_send_the_same_bytes_and_mhc_n_times_vanilla():
    def bounds(*o):
        return plan(_cfg("parallel.pp_stages=4", "parallel.partition_method=uniform", *o))["boundaries"]

    msar, attnres = bounds("residual=msar", "residual.n_blocks=4"), bounds("residual=attnres", "residual.n_blocks=4")
    assert [b["bytes_per_microbatch"] for b in msar] == [b["bytes_per_microbatch"] for b in attnres]
    # 4 summary blocks of 2 layers; a uniform cut after an odd layer carries the open block's partial.
    assert [t["name"] for t in msar[0]["tensors"]] == ["aux", "b_0", "partial_b_1"] and msar[0]["after_layer"] == 1
    for n in (2, 4):
        mhc, van = bounds("residual=mhc", f"residual.mhc_streams={n}"), bounds("residual=vanilla")
        assert [b["state_bytes_per_microbatch"] for b in mhc] == [n * b["state_bytes_per_microbatch"] for b in van]
        assert _shapes(mhc[0]["tensors"])[-1] == ([2, 32, n, 128], "float32")


def test_blocks_partition_sends_no_partial():
    p = plan(_cfg("residual=msar", "residual.n_blocks=4", "parallel.pp_stages=2", "parallel.partition_method=blocks"))
    (b,) = p["boundaries"]
    assert [t["name"] for t in b["tensors"]] == ["aux", "b_0", "b_1", "b_2"] and b["after_layer"] == 4


def test_bfloat16_halves_the_float_bytes():
    f32 = plan(_cfg("residual=msar", "parallel.pp_stages=2"))["boundaries"][0]
    bf16 = plan(_cfg("residual=msar", "parallel.pp_stages=2", "parallel.dtype=bfloat16"))["boundaries"][0]
    assert {t["dtype"] for t in bf16["tensors"]} == {"bfloat16"}
    assert 2 * bf16["bytes_per_microbatch"] == f32["bytes_per_microbatch"]


@pytest.mark.parametrize("backend", ["vanilla", "msar"])
def test_stage_params_add_up(backend):
    """Vanilla shares nothing: the stages add up to the model. MSAR stages replicate the source
    expansions their layers read, so they add up to at least the model."""
    cfg = _cfg(f"residual={backend}", "parallel.pp_stages=3", "parallel.partition_method=parameters")
    total = count_params(cfg)["total_params"]
    stages = plan(cfg)["stages"]
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == cfg.model.n_layers + 2
    assert all(a["layers"][1] == b["layers"][0] for a, b in zip(stages, stages[1:]))
    got = sum(s["params"] for s in stages)
    assert got == total if backend == "vanilla" else got > total


def test_cli_moe_18b_8_stages_is_fast_and_allocates_nothing(capsys):
    t0 = time.perf_counter()
    assert plan_main(["model=moe_18b", "parallel.pp_stages=8", "residual=msar"]) == 0
    assert time.perf_counter() - t0 < 60
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    p = json.loads(lines[0])
    assert (p["model"], p["residual"], p["pp_stages"], len(p["stages"]), len(p["boundaries"])) == ("moe_18b", "msar", 8, 8, 7)
    assert sum(s["params"] for s in p["stages"]) > 18e9
    # blocks partition: every cut follows a completed summary block
    assert all(not t["name"].startswith("partial") for b in p["boundaries"] for t in b["tensors"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_virtual_stages_place_chunk_c_on_rank_c_mod_p_and_report_the_cache(backend):
    cfg = _cfg(f"residual={backend}", "parallel.pp_stages=2", "parallel.virtual_stages=2", "parallel.grad_accum=2", "residual.n_blocks=8")
    p = plan(cfg)
    assert p["virtual_stages"] == 2 and len(p["boundaries"]) == 3
    chunks = sorted((c["chunk"], s["stage"], tuple(c["layers"])) for s in p["stages"] for c in s["chunks"])
    assert [(c, r) for c, r, _ in chunks] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    assert chunks[0][2][0] == 0 and chunks[-1][2][1] == cfg.model.n_layers + 2
    assert all(a[2][1] == b[2][0] for a, b in zip(chunks, chunks[1:]))
    assert all("layers" not in s for s in p["stages"])  # several ranges per rank: only under "chunks"
    assert [(b["from_stage"], b["to_stage"]) for b in p["boundaries"]] == [(0, 1), (1, 0), (0, 1)]
    per_step = cfg.parallel.grad_accum * sum(b["hop_bytes_cached"] for b in p["boundaries"])
    assert p["comm_bytes_cached"] == per_step
    assert p["comm_bytes_naive"] == cfg.parallel.grad_accum * sum(b["hop_bytes_naive"] for b in p["boundaries"])
    # a hop's naive bytes: its carry forward plus the gradients of its float tensors back (all float here)
    assert all(b["hop_bytes_naive"] == 2 * b["bytes_per_microbatch"] for b in p["boundaries"])
    if backend in ("attnres", "msar"):  # hop 2 (rank 1 -> 0) carries only summaries rank 0 lacks
        assert p["comm_bytes_cached"] < p["comm_bytes_naive"]
        assert p["boundaries"][1]["hop_bytes_cached"] < p["boundaries"][1]["hop_bytes_naive"]
    else:  # vanilla's hidden state / mHC's streams change at every layer: nothing to cache
        assert p["comm_bytes_cached"] == p["comm_bytes_naive"]


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["parallel.pp_stages=9"], "parallel.pp_stages"),  # tiny has 8 blocks
        (["parallel.partition_method=random"], "parallel.partition_method"),
        (["parallel.dtype=fp8"], "parallel.dtype"),
        (["parallel.pp_stages=8", "residual=msar", "residual.n_blocks=2"], "parallel.partition_method"),  # 2 blocks: 2 cuts only
    ],
)
def test_cli_bad_config_exits_2_naming_the_field(capsys, overrides, field):
    assert plan_main(["model=tiny", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("msar-plan: ") and field in err


# --------------------------------------------------------------------------------------------------
# Against a real 2-rank pipeline run
# --------------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_sent_and_received_tensors_match_the_plan(runs, backend):
    run_dir = runs.pipeline_dir(backend)
    ranks = [json.loads((run_dir / "p2p" / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = plan(compose_config([*COMMON, f"residual={backend}", "parallel=pp2"]))
    (boundary,) = expected["boundaries"]
    want = _shapes(boundary["tensors"])
    assert [r["stage"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["parts"] == [s["layers"][0] for s in expected["stages"]] + [expected["stages"][-1]["layers"][1]]
    sent, received = ranks[0]["sent"], ranks[1]["received"]
    assert len(sent) >= 6 and len(received) == len(sent)  # 3 steps x 2 micro-batches (+ evaluation)
    assert ranks[0]["received"] == [] and ranks[1]["sent"] == []
    for s, r in zip(sent, received):
        assert [(t["shape"], t["dtype"]) for t in s] == want
        assert [(t["shape"], t["dtype"]) for t in r] == want
