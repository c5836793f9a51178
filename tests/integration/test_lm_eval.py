"""lm-evaluation-harness on msar-train models: exported folders through lm-eval's own ``hf`` model
class, and ``trainer.eval_harness`` during training. The tasks are built from local text
(``msar_train.export.harness``): this machine cannot reach the hub."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("lm_eval")

from msar_train.export import harness, hf  # noqa: E402
from msar_train.train.cli import main  # noqa: E402
from msar_train.train.metrics import read_metrics  # noqa: E402
from tests.unit.export_helpers import TEXTS, make_run  # noqa: E402

TEXT = (
    "\n".join(dict.fromkeys(TEXTS))
    + "\n"
    + "\n".join(
        [
            "Now is the winter of our discontent made glorious summer by this sun of York",
            "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him",
            "Shall I compare thee to a summer's day? Thou art more lovely and more temperate",
            "If music be the food of love, play on; give me excess of it, that surfeiting",
        ]
    )
)
TASKS = ["msar_local_mc", "msar_local_rolling", "msar_local_gen"]


@pytest.fixture(autouse=True)
def _offline_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))  # the json tasks' cache


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    run, _ = make_run(root, "msar")
    out = hf.export(run, root / "hf")
    tasks_dir = root / "tasks"
    assert harness.write_local_tasks(tasks_dir, TEXT, n=7) == TASKS
    return out, tasks_dir


def _lm_eval(out, tasks_dir, tasks):
    import lm_eval

    manager = harness.task_manager(tasks, tasks_dir)
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={out},trust_remote_code=True,dtype=float32",
        tasks=tasks,
        task_manager=manager,
        batch_size=4,
        device="cpu",
        log_samples=True,
    )
    return res, harness.scores(res)


def test_three_request_types_on_an_exported_folder_match_our_own_logits(exported):
    out, tasks_dir = exported
    res, got = _lm_eval(out, tasks_dir, TASKS)
    for key in (
        "msar_local_mc/acc",
        "msar_local_rolling/bits_per_byte",
        "msar_local_rolling/word_perplexity",
        "msar_local_gen/exact_match_first_word",
    ):
        assert math.isfinite(got[f"harness/{key}"]), key
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(out)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            lp = torch.log_softmax(m(torch.tensor([ids])).logits[0].double(), -1)
        return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)

    # multiple choice: the argmax of sum log p(ending | start), lm-eval's own split of the tokens
    correct = []
    for s in res["samples"]["msar_local_mc"]:
        doc = s["doc"]
        ctx = tok.encode(doc["question"], add_special_tokens=False)
        lls = []
        for ending in doc["choices"]:
            whole = tok.encode(doc["question"] + ending, add_special_tokens=False)
            lls.append(float(logprobs(whole)[len(ctx) - 1 :].sum()))
        correct.append(float(max(range(4), key=lls.__getitem__) == doc["label"]))
    assert got["harness/msar_local_mc/acc"] == pytest.approx(sum(correct) / len(correct))
    # rolling: nats of every token after the prefix token (EOS), over the text's UTF-8 bytes
    nats, nbytes = 0.0, 0
    for s in res["samples"]["msar_local_rolling"]:
        text = s["doc"]["text"]
        nats -= float(logprobs([tok.eos_token_id, *tok.encode(text, add_special_tokens=False)]).sum())
        nbytes += len(text.encode("utf-8"))
    assert got["harness/msar_local_rolling/bits_per_byte"] == pytest.approx(nats / nbytes / math.log(2), rel=1e-5)


def test_trainer_logs_harness_scores_next_to_val_loss(exported, tmp_path):
    _, tasks_dir = exported
    rd = tmp_path / "run"
    args = [
        "model=tiny",
        "data.seq_len=32",
        "parallel.micro_batch_size=2",
        "trainer.max_steps=4",
        "trainer.eval_every=2",
        "trainer.eval_batches=1",
        "trainer.progress=false",
        f"trainer.run_dir={rd}",
        f"trainer.eval_harness.tasks=[{','.join(TASKS[:2])}]",
        f"trainer.eval_harness.include_path={tasks_dir}",
        "trainer.eval_harness.limit=3",
    ]
    assert main(args) == 0
    rows = [r for r in read_metrics(rd / "metrics.jsonl") if "val/loss" in r]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert 0.0 <= r["harness/msar_local_mc/acc"] <= 1.0 and math.isfinite(r["harness/msar_local_rolling/bits_per_byte"])
    assert rows[0]["harness/msar_local_rolling/bits_per_byte"] != rows[1]["harness/msar_local_rolling/bits_per_byte"]  # live weights


def test_unknown_task_and_bad_text_exit_2_naming_them(exported, tmp_path, capsys):
    _, tasks_dir = exported
    rd = tmp_path / "run"
    args = ["model=tiny", "data.seq_len=32", "trainer.max_steps=1", "trainer.progress=false", f"trainer.run_dir={rd}"]
    assert main([*args, "trainer.eval_harness.tasks=[no_such_task]", f"trainer.eval_harness.include_path={tasks_dir}"]) == 2
    err = capsys.readouterr().err
    assert "trainer.eval_harness.tasks" in err and "no_such_task" in err
    short = tmp_path / "short.txt"
    short.write_text("too short\n")
    assert harness.main([str(tmp_path / "t"), str(short)]) == 2
    assert "at least 4" in capsys.readouterr().err
    assert harness.main([str(tmp_path / "t"), str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
