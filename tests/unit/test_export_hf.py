"""msar-export / msar-generate on tiny checkpoints written without training (``export_helpers.make_run``).

Parity: for every residual preset the exported folder, loaded by ``transformers``' Auto classes, gives
the training ``Transformer``'s fp32 logits (measured: bitwise; asserted within 1e-6 relative). The four
main backends run by default, the ablation presets are ``slow``.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from msar_train.export import generate as gen
from msar_train.export import hf
from tests.unit.export_helpers import make_run
from tests.unit.helpers import RESIDUAL_PRESETS

MAIN = ["vanilla", "mhc", "attnres", "msar"]
PRESETS = [p if p in MAIN else pytest.param(p, marks=pytest.mark.slow) for p in RESIDUAL_PRESETS]


def _load(out, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, **kw).eval()


def _ids(tok, text="To be, or not to be, that is the question"):
    return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("residual", PRESETS)
def test_logits_equal_the_training_model(tmp_path, residual):
    run, model = make_run(tmp_path, residual)
    out = hf.export(run, tmp_path / "hf")
    m, tok = _load(out), AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    ids = torch.cat([_ids(tok), _ids(tok, " All the world")], dim=1)
    labels = ids.clone()
    with torch.no_grad():
        ref, _ = model(ids)
        got = m(ids, labels=labels)
    assert rel(got.logits, ref) <= 1e-6
    ce = torch.nn.functional.cross_entropy(ref[0, :-1], ids[0, 1:])
    assert torch.allclose(got.loss, ce, rtol=1e-6)


def test_config_round_trips_every_field(tmp_path):
    run, _ = make_run(tmp_path, "msar", **{"model.tie_embeddings": "true"})
    cfg_saved = json.loads((run / "checkpoints" / "step00000001" / "manifest.json").read_text())["config"]
    out = hf.export(run, tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    for f in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert f in names
    assert {"special_tokens_map.json", *hf.REMOTE_CODE} <= names
    cfg = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert cfg.model_type == "msar" and cfg.auto_map == hf.AUTO_MAP
    assert cfg.msar_model == cfg_saved["model"] and cfg.msar_residual == cfg_saved["residual"]
    assert cfg.document_mask is cfg_saved["data"]["document_mask"] and cfg.tie_word_embeddings
    assert cfg.msar_version and cfg.msar_git_commit and cfg.train_git_commit == "abc123"
    gcfg = json.loads((out / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert gcfg["eos_token_id"] == tok.eos_token_id == 0 and gcfg["pad_token_id"] == tok.pad_token_id == 1
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    # training's contract: the literal EOS text inside a prompt is ordinary text
    assert 0 not in tok("a <|endoftext|> b", add_special_tokens=False)["input_ids"]


def test_tied_and_document_mask_models_export(tmp_path):
    run, model = make_run(tmp_path, "msar", name="dm", **{"model.tie_embeddings": "true", "data.document_mask": "true"})
    out = hf.export(run, tmp_path / "hf")
    m, tok = _load(out), AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    ids = _ids(tok)
    T = ids.shape[1]
    with torch.no_grad():
        ref, _ = model(ids, torch.zeros_like(ids), torch.arange(T)[None])
        assert rel(m(ids).logits, ref) <= 1e-6
    # aliased parameters (MSAR's shared source expansions) are one parameter again after loading
    assert m._aliases and all(m.get_parameter(a) is m.get_parameter(b) for a, *rest in m._aliases for b in rest)


def test_greedy_generate_equals_an_argmax_loop(tmp_path):
    run, model = make_run(tmp_path, "msar")
    out = hf.export(run, tmp_path / "hf")
    m, tok = _load(out), AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    ids = _ids(tok)
    with torch.no_grad():
        got = m.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
        seq = ids
        for _ in range(8):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got.tolist() == seq.tolist()
    torch.manual_seed(0)
    sampled = m.generate(ids, max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, eos_token_id=None)
    torch.manual_seed(0)
    again = m.generate(ids, max_new_tokens=8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, eos_token_id=None)
    assert sampled.shape == (1, ids.shape[1] + 8) and torch.equal(sampled, again)


def test_small_shard_size_writes_an_index_that_loads(tmp_path):
    run, model = make_run(tmp_path, "attnres")
    out = hf.export(run, tmp_path / "hf", shard_size="20KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert all((out / s).is_file() for s in shards) and len(index["weight_map"]) == len(model.state_dict())
    m, tok = _load(out), AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    with torch.no_grad():
        assert rel(m(_ids(tok)).logits, model(_ids(tok))[0]) <= 1e-6


def test_bf16_export_loads(tmp_path):
    run, model = make_run(tmp_path, "msar")
    out = hf.export(run, tmp_path / "hf", dtype="bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    m, tok = _load(out), AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert m.dtype == torch.bfloat16
    with torch.no_grad():
        assert rel(m(_ids(tok)).logits.float(), model(_ids(tok))[0]) < 0.05  # bf16 rounding of the weights


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda run: run.rename(run.with_name("gone")), "not a checkpoint"),
        (lambda run: (run / "checkpoints/step00000001/mp_rank_00_model_states.pt").write_bytes(b"x"), "corrupted"),
        (lambda run: (run / "checkpoints/step00000001/manifest.json").unlink(), "no valid checkpoint"),
    ],
    ids=["missing", "corrupt", "incomplete"],
)
def test_bad_checkpoint_exits_2_naming_it(tmp_path, capsys, damage, message):
    run, _ = make_run(tmp_path, "vanilla")
    damage(run)
    assert hf.main([str(run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("msar-export: error: ") and message in err and str(run) in err and "\n" not in err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp-*"))


def test_non_empty_out_dir_needs_overwrite(tmp_path, capsys):
    run, _ = make_run(tmp_path, "vanilla")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert hf.main([str(run), str(out)]) == 2
    assert "not empty; pass overwrite=true" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert hf.main([str(run), str(out), "overwrite=true"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]


def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    run, _ = make_run(tmp_path, "vanilla")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "write_safetensors", boom)
    with pytest.raises(OSError):
        hf.export(run, tmp_path / "hf")
    assert not [p for p in tmp_path.iterdir() if "hf" in p.name]


@pytest.mark.parametrize(
    "arg,message",
    [("dtype=fp16", "dtype=fp16"), ("shard_size=big", "shard_size=big"), ("colour=red", "colour=red"), ("kernel=cuda", "kernel=cuda")],
)
def test_bad_options_exit_2(tmp_path, capsys, arg, message):
    run, _ = make_run(tmp_path, "vanilla")
    assert hf.main([str(run), str(tmp_path / "hf"), arg]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "hf").exists()


def test_moved_tokenizer_is_named_and_can_be_given(tmp_path, capsys):
    run, _ = make_run(tmp_path, "vanilla")
    (tmp_path / "data").rename(tmp_path / "moved")
    assert hf.main([str(run), str(tmp_path / "hf")]) == 2
    assert "tokenizer=PATH" in capsys.readouterr().err
    assert hf.main([str(run), str(tmp_path / "hf"), f"tokenizer={tmp_path / 'moved'}"]) == 0


def test_generate_cli_from_run_dir_and_hf_dir(tmp_path, capsys):
    run, _ = make_run(tmp_path, "msar")
    out = hf.export(run, tmp_path / "hf")
    texts = []
    for src in (run, out):
        assert gen.main([str(src), "prompt=To be, or not", "max_new_tokens=6"]) == 0
        texts.append(capsys.readouterr().out.strip())
    assert texts[0] == texts[1] and texts[0].startswith("To be, or not") and len(texts[0]) > len("To be, or not")
    assert gen.main([str(out), "prompt=To be", "max_new_tokens=6", "temperature=0.9", "top_k=10", "top_p=0.9", "seed=3"]) == 0
    assert capsys.readouterr().out.startswith("To be")


def test_generate_refuses_a_prompt_longer_than_max_seq_len(tmp_path, capsys):
    run, _ = make_run(tmp_path, "vanilla")
    long = " ".join(["question"] * 80)  # > 64 tokens
    assert gen.main([str(run), f"prompt={long}", "max_new_tokens=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("msar-generate: error: prompt: ") and "max_seq_len=64" in err
    assert gen.main([str(tmp_path / "nothing"), "prompt=a"]) == 2
    assert str(tmp_path / "nothing") in capsys.readouterr().err


def test_kernel_option_sets_residual_kernel(tmp_path):
    run, _ = make_run(tmp_path, "msar")
    assert hf.main([str(run), str(tmp_path / "hf"), "kernel=compile"]) == 0
    assert AutoConfig.from_pretrained(tmp_path / "hf", trust_remote_code=True).msar_residual["kernel"] == "compile"


def test_checkpoint_and_checkpoints_dirs_export_too(tmp_path):
    run, model = make_run(tmp_path, "mhc")
    for i, src in enumerate((run / "checkpoints", run / "checkpoints" / "step00000001")):
        assert hf.main([str(src), str(tmp_path / f"hf{i}")]) == 0
    m, tok = _load(tmp_path / "hf1"), AutoTokenizer.from_pretrained(tmp_path / "hf1", trust_remote_code=True)
    with torch.no_grad():
        assert torch.equal(m(_ids(tok)).logits, model(_ids(tok))[0])


def test_another_package_version_warns_and_an_unknown_field_raises(tmp_path):
    run, _ = make_run(tmp_path, "vanilla")
    out = hf.export(run, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "msar_version": "0.0.1"}))
    with pytest.warns(UserWarning, match="exported by msar_train 0.0.1"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    (out / "config.json").write_text(json.dumps({**cfg, "msar_model": {**cfg["msar_model"], "new_knob": 1}}))
    with pytest.raises(ValueError, match="new_knob"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
