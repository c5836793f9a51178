"""scripts/pipeline_comm_table.py: the summary traffic of the hop plan against closed forms."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pipeline_comm_table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("_pipeline_comm_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _no_launcher_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("P,V,blocks_per_chunk", [(2, 2, 1), (2, 2, 2), (4, 2, 1), (2, 4, 1)])
def test_block_aligned_chunks_match_the_closed_forms(table, P, V, blocks_per_chunk):
    C = P * V
    N = C * blocks_per_chunk
    r = table.row(P, V, N, d=128, layers=N, seq=16, partition_method="blocks")
    # naive: hop c carries b_0 and the c * N_p completed blocks -> the paper's C(C-1)/2 N_p plus b_0 per hop
    assert r["paper_naive"] == C * (C - 1) / 2 * blocks_per_chunk
    assert r["summary_fwd_naive"] == r["paper_naive"] + (C - 1)
    # cached: the first P-1 hops as naive; later hops only the (P-1) chunks' blocks since the rank last held it
    first = sum(1 + c * blocks_per_chunk for c in range(1, P))
    assert r["summary_fwd_cached"] == first + (C - P) * (P - 1) * blocks_per_chunk
    assert r["step_GB_cached"] < r["step_GB_naive"] and 0 < r["saving"] < 1


def test_cli_writes_a_table_and_json(table, tmp_path, capsys):
    out = tmp_path / "t.json"
    args = ["--pp", "2", "--vp", "2", "--blocks", "4", "--d-model", "256", "--layers", "8", "--seq", "32", "--json", str(out)]
    assert table.main(args) == 0
    text = capsys.readouterr().out
    assert "| 2 | 2 | 4 | 4 |" in text
    (row,) = json.loads(out.read_text())
    assert row["C"] == 4 and row["summary_fwd_cached"] < row["summary_fwd_naive"]


def test_cli_impossible_layout_exits_2(table, capsys):
    assert table.main(["--pp", "16", "--vp", "4", "--layers", "8", "--d-model", "256", "--blocks", "4"]) == 2
    assert "pipeline_comm_table:" in capsys.readouterr().err
