"""scripts/bench_residuals.py runs end to end on a tiny model (no timing assertions)."""

import json

from tests.unit.helpers import load_script


def _load():
    return load_script("bench_residuals")


def test_bench_runs_on_a_tiny_config(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "bench.json"
    args = ["--config", "tiny", "--layers", "2", "--batch", "2", "--seq", "8", "--steps", "1", "--warmup", "0"]
    assert bench.main([*args, "--backends", "vanilla", "attnres", "msar", "mhc", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["backend"] for r in rows] == ["vanilla", "attnres", "msar", "mhc", "hf_deepseek_v3"]
    for r in rows:
        for key in ("backend", "step_time_median_s", "ratio_vs_vanilla", "peak_mem_bytes", "param_overhead"):
            assert key in r
        assert r["step_time_median_s"] > 0 and r["peak_mem_bytes"] > 0
    van = rows[0]
    assert van["ratio_vs_vanilla"] == 1.0 and van["param_overhead"] == 0.0
    assert rows[2]["param_overhead"] > rows[1]["param_overhead"] > 0  # msar > attnres > vanilla
    assert rows[2]["flops_overhead"] > rows[1]["flops_overhead"] > 0
    assert rows[-1]["vanilla_tokens_per_s_ratio"] > 0
    printed = capsys.readouterr().out
    assert "| backend |" in printed and "hf_deepseek_v3" in printed


def test_deep_preset_has_six_targets_per_msar_block():
    from msar_train.residual.layout import BlockLayout

    bench = _load()
    mc = bench.model_config("deep")
    assert (mc.n_layers, mc.d_model) == (24, 256) and mc.d_model % mc.n_heads == 0
    res = bench.residual_config("msar", "torch")
    sizes = {hi - lo + 1 for lo, hi in BlockLayout(2 * mc.n_layers, res.n_blocks).bounds}
    assert res.n_blocks == 8 and sizes == {6}
