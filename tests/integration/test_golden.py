"""Golden runs (``scripts/golden_runs.py``, files in ``tests/golden/``): today's per-step numerics of
every residual preset and of a PP2 V2 run, bitwise on the platform that wrote them.

The default run checks the four backends and the PP2 V2 run (~40 s); the ablation presets run in
``make test-all`` (slow)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.distributed._launch import REPO, env

BACKENDS = ["vanilla", "mhc", "attnres", "msar"]


def _golden():
    spec = importlib.util.spec_from_file_location("golden_runs", REPO / "scripts" / "golden_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(names: list[str], mode: str = "--check") -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "golden_runs.py"), mode, *names],
        env=env(), cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "golden runs match" in proc.stdout


def test_every_preset_has_a_golden_file():
    g = _golden()
    have = {p.stem for p in g.GOLDEN.glob("*.json")}
    assert have == {*g.presets(), f"{g.PIPE_PRESET}-pp2-v2"}
    for name in have:
        d = json.loads((g.GOLDEN / f"{name}.json").read_text())
        assert [s["step"] for s in d["steps"]] == list(range(1, g.STEPS + 1))
        assert set(d["platform"]) == {"torch", "deepspeed", "machine", "cpu_capability", "cpu", "cpu_cache", "cpu_isa"}
        assert d["tolerance_rel"]


def test_two_cpus_with_the_same_simd_level_are_different_platforms():
    g = _golden()
    info = "model name\t: Xeon X\ncache size\t: 1024 KB\nflags\t\t: fpu avx2 avx512f fma amx_tile pse\n"
    assert g.cpu_identity(info) == {"cpu": "Xeon X", "cpu_cache": "1024 KB", "cpu_isa": "amx_tile avx2 avx512f fma"}
    assert g.cpu_identity(info.replace(" amx_tile", "")) != g.cpu_identity(info)  # same AVX512 level, no AMX
    assert g.cpu_identity(info.replace("1024", "2048")) != g.cpu_identity(info)


def test_compare_is_bitwise_on_the_same_platform_else_within_the_tolerance(monkeypatch):
    g = _golden()
    facts = {"torch": "t", "deepspeed": "d", "machine": "m", "cpu_capability": "c"}
    monkeypatch.setattr(g, "platform_facts", lambda: facts)
    golden = {"name": "x", "platform": dict(facts), "tolerance_rel": {"train/loss": 1e-3}, "steps": [{"step": 1, "train/loss": 2.0}]}
    assert g.compare(golden, [{"step": 1, "train/loss": 2.0}]) == []
    assert g.compare(golden, [{"step": 1, "train/loss": 2.0 + 1e-9}])  # one ulp-ish: bitwise fails
    golden["platform"]["cpu_capability"] = "other"
    assert g.compare(golden, [{"step": 1, "train/loss": 2.0 + 1e-9}]) == []
    assert g.compare(golden, [{"step": 1, "train/loss": 2.01}])
    golden["steps"][0]["comm/bytes_per_step"] = 10
    assert g.compare(golden, [{"step": 1, "train/loss": 2.0, "comm/bytes_per_step": 11}])  # bytes: always exact


@pytest.mark.distributed
def test_backends_and_the_pp2_v2_run_match_their_golden_files():
    _check(BACKENDS)


@pytest.mark.slow
def test_ablation_presets_match_their_golden_files():
    g = _golden()
    _check([p for p in g.presets() if p not in BACKENDS])


def test_the_backends_train_in_bf16_on_cpu_close_to_fp32():
    """parallel.dtype=bfloat16 on CPU: finite, and within golden_runs.BF16_TOL nats of the fp32 golden losses."""
    _check(BACKENDS, "--bf16")


@pytest.mark.slow
def test_the_ablation_presets_train_in_bf16_on_cpu_close_to_fp32():
    g = _golden()
    _check([p for p in g.presets() if p not in BACKENDS], "--bf16")


def test_depth_attention_statistics_stay_fp32_for_bf16_activations():
    """The spec: softmax statistics (max, sum of exponentials) in fp32 whatever the activation dtype."""
    import torch

    from msar_train.kernels.depth_attention import expand_keys, phase1, phase2

    B, T, D, M = 2, 5, 16, 3
    gen = torch.Generator().manual_seed(0)

    def expand(s):
        return expand_keys([s * (r + 1) for r in range(M)], 1e-6)

    srcs = [(torch.randn(B, T, D, generator=gen).to(torch.bfloat16), expand) for _ in range(3)]
    qg = torch.randn(M, D, generator=gen)
    p1 = phase1(srcs[:2], qg, 1e-6)
    assert p1.mx_MBT.dtype == torch.float32 and p1.se_MBT.dtype == torch.float32
    z = phase2(p1, srcs[2], qg, 1e-6)
    assert z.dtype == torch.bfloat16 and torch.isfinite(z.float()).all()
