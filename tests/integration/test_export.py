"""msar-export / msar-generate on a real training run (a 2-step tiny msar job), as separate processes.

The exported folder is loaded in a fresh interpreter that imports only ``transformers`` (the remote code
imports ``msar_train`` itself); its greedy ``generate`` must give the tokens of a plain argmax loop over
the checkpoint's own ``Transformer`` (``checkpoint.load_model``) and its logits that model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from msar_train.train.checkpoint import load_model
from tests.distributed._launch import REPO, env

TIMEOUT_S = 300
TRAIN = [
    "model=tiny",
    "residual=msar",
    "data.seq_len=32",
    "parallel.micro_batch_size=2",
    "trainer.max_steps=2",
    "trainer.eval_every=2",
    "trainer.eval_batches=1",
    "trainer.save_every=0",
    "trainer.progress=false",
    "logger.mode=disabled",
]
PROMPT = "ROMEO: But soft, what light"
FRESH = """
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
out, prompt = sys.argv[1], sys.argv[2]
cfg = AutoConfig.from_pretrained(out, trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
ids = tok(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
with torch.no_grad():
    logits = model(ids).logits
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    torch.manual_seed(0)
    sampled = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=0.7, top_k=50, top_p=0.95, eos_token_id=None)
torch.save({"ids": ids, "logits": logits}, out + ".probe.pt")
print(json.dumps({"type": type(model).__name__, "model_type": cfg.model_type, "eos": tok.eos_token,
                  "greedy": greedy[0].tolist(), "sampled": sampled[0].tolist(), "text": tok.decode(greedy[0])}))
"""


def run(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], env=env(), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == rc, f"rc {proc.returncode} (want {rc}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("export") / "run"
    run("-m", "msar_train.train", *TRAIN, f"trainer.run_dir={run_dir}")
    return run_dir


def test_export_loads_in_a_fresh_process_and_generates_like_the_training_model(trained, tmp_path):
    out = tmp_path / "hf"
    proc = run("-m", "msar_train.export.hf", str(trained), str(out))
    assert f"exported to {out}" in proc.stdout
    got = json.loads(run("-c", FRESH, str(out), PROMPT).stdout.strip().splitlines()[-1])
    assert got["type"] == "MsarForCausalLM" and got["model_type"] == "msar" and got["eos"] == "<|endoftext|>"

    model, _ = load_model(trained)
    probe = torch.load(str(out) + ".probe.pt")
    ids = probe["ids"]
    with torch.no_grad():
        ref = model(ids)[0]
        seq = ids
        for _ in range(12):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ((probe["logits"] - ref).abs().max() / ref.abs().max()).item() <= 1e-6
    assert got["greedy"] == seq[0].tolist()
    assert len(got["sampled"]) == ids.shape[1] + 12 and got["text"].startswith(PROMPT)


def test_generate_cli_on_the_run_dir(trained):
    proc = run(
        "-m", "msar_train.export.generate", str(trained), f"prompt={PROMPT}", "max_new_tokens=8", "temperature=0.8", "top_k=40", "seed=1"
    )
    assert proc.stdout.startswith(PROMPT) and len(proc.stdout.strip()) > len(PROMPT)
    long = "ROMEO " * 300  # > max_seq_len=256 tokens of model=tiny
    proc = run("-m", "msar_train.export.generate", str(trained), f"prompt={long}", "max_new_tokens=2", rc=2)
    assert proc.stderr.startswith("msar-generate: error: prompt: ") and "max_seq_len=256" in proc.stderr


def test_missing_package_is_a_clear_error(trained, tmp_path):
    out = tmp_path / "hf"
    run("-m", "msar_train.export.hf", str(trained), str(out), "dtype=bf16")
    code = (
        "import sys; sys.modules['msar_train'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        "AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)"
    )
    proc = run("-c", code, str(out), rc=1)
    assert "msar_train" in proc.stderr.strip().splitlines()[-1]
