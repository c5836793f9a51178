"""lm-evaluation-harness on msar-train models (the optional ``[eval]`` extra: ``lm-eval``, ``accelerate``).

Exported folders need nothing from here: ``lm_eval --model hf --model_args
pretrained=OUT_DIR,trust_remote_code=True --tasks hellaswag,arc_easy --batch_size 8`` runs them like any
Hugging Face causal LM (loglikelihood requests through the plain forward, ``generate_until`` through
the cached, left-padded ``generate``). This module adds two things:

* **Local tasks** for machines without the hub: ``python -m msar_train.export.harness OUT_DIR TEXT_FILE
  [n=40] [prefix=msar_local]`` writes three lm-eval tasks (YAML with ``dataset_path: json`` and
  ``data_files`` pointing at jsonl files next to them) built from the lines of a text file:
  ``<prefix>_mc`` (multiple choice: a line's true ending among three other lines' endings; metric
  ``acc``, loglikelihood requests), ``<prefix>_rolling`` (the lines' perplexity: ``word_perplexity``,
  ``byte_perplexity``, ``bits_per_byte``; loglikelihood_rolling) and ``<prefix>_gen`` (greedy
  continuation of a line's start until a newline, ``exact_match`` against its next word;
  generate_until). Then ``lm_eval ... --tasks <prefix>_mc,... --include_path OUT_DIR``.
* **In-training scores** (``trainer.eval_harness``): ``HarnessRunner`` wraps the training model
  itself (no copy of the weights, no export) in ``MsarForCausalLM`` and lm-eval's ``HFLM`` and runs the
  configured tasks; ``scores`` flattens lm-eval's results to ``harness/<task>/<metric>``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from msar_train.errors import InputError, run_cli

MIN_WORDS = 6  # a line needs a start and an ending of at least 3 words each


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError as e:
        raise InputError(f"lm-evaluation-harness is not installed ({e}); pip install 'msar-train[eval]'") from None


# ---------------------------------------------------------------------------------- local tasks
def _lines(text: str) -> list[list[str]]:
    return [ws for line in text.splitlines() if len(ws := line.split()) >= MIN_WORDS]


def write_local_tasks(out_dir: str | Path, text: str, n: int = 40, prefix: str = "msar_local", seed: int = 0) -> list[str]:
    """Write the three local tasks (YAML + jsonl) into ``out_dir`` from ``text``; returns their names."""
    if not prefix.isidentifier():
        raise InputError(f"prefix={prefix!r}: must be a Python identifier (letters, digits, _)")
    lines = _lines(text)
    if len(lines) < 4:
        raise InputError(f"the text has {len(lines)} lines of >= {MIN_WORDS} words; the tasks need at least 4")
    rng = random.Random(seed)
    picked = rng.sample(lines, min(n, len(lines)))
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    mc, rolling, gen = [], [], []
    for ws in picked:
        cut = len(ws) // 2
        others = [o for o in picked if o is not ws]
        endings = [" " + " ".join(ws[cut:])] + [" " + " ".join(o[len(o) // 2 :]) for o in rng.sample(others, 3)]
        order = list(range(4))
        rng.shuffle(order)
        mc.append({"question": " ".join(ws[:cut]), "choices": [endings[k] for k in order], "label": order.index(0)})
        rolling.append({"text": " ".join(ws)})
        gen.append({"prompt": " ".join(ws[:cut]), "answer": " " + ws[cut]})
    files = {"mc": mc, "rolling": rolling, "gen": gen}
    for kind, rows in files.items():
        (out / f"{prefix}_{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    yamls = {
        "mc": 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{label}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n',
        "rolling": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        "gen": 'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\ntarget_delimiter: ""\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        'filter_list:\n  - name: first_word\n    filter:\n      - function: regex\n        regex_pattern: "^(\\\\s*\\\\S+)"\n'
        "      - function: take_first\n"
        "metric_list:\n  - metric: exact_match\n",
    }
    names = []
    for kind, body in yamls.items():
        name = f"{prefix}_{kind}"
        head = f"task: {name}\n" + common.format(path=json.dumps(str((out / f"{name}.jsonl").resolve())))
        (out / f"{name}.yaml").write_text(head + body, encoding="utf-8")
        names.append(name)
    return names


# ----------------------------------------------------------------------------------- running
def scores(results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's ``simple_evaluate`` output -> ``{"harness/<task>/<metric>": value}`` (stderr left out;
    a filter other than ``none`` is appended: ``exact_match_first_word``)."""
    out: dict[str, float] = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if "_stderr" in metric or key == "alias" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[f"harness/{task}/{name}"] = float(value)
    return out


def task_manager(tasks: list[str], include_path: str | Path | None, field: str = "tasks"):
    """lm-eval's ``TaskManager`` over its registry (+ ``include_path``), refusing unknown ``tasks``."""
    _require_lm_eval()
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or under include_path={include_path}" if include_path else ""
        raise InputError(f"{field}: lm-eval knows no task {', '.join(unknown)} (its registry{where})")
    return manager


def evaluate(lm, tasks: list[str], manager, limit: int | None = None) -> dict[str, float]:
    """Run ``tasks`` on an lm-eval ``LM`` (``manager``: ``task_manager(...)``); flat scores."""
    import lm_eval

    res = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, log_samples=False, verbosity="ERROR")
    return scores(res)


class HarnessRunner:
    """``trainer.eval_harness`` on the training model itself (single-stage, no expert parallelism)."""

    def __init__(self, cfg, model) -> None:
        _require_lm_eval()
        from lm_eval.models.huggingface import HFLM

        from msar_train.export.hf import hf_config, run_tokenizer
        from msar_train.export.modeling_msar import MsarForCausalLM

        h = cfg.trainer.eval_harness
        self.tasks, self.limit = list(h.tasks), h.limit
        self.manager = task_manager(self.tasks, h.include_path, "trainer.eval_harness.tasks")
        tok, eos_id, pad = run_tokenizer(cfg, {})
        # The wrapper is built on the meta device (no memory), then its Transformer is replaced by the
        # training one: lm-eval sees the live weights, nothing is copied.
        import torch

        with torch.device("meta"):
            wrapper = MsarForCausalLM(hf_config(cfg, eos_id, pad, next(model.parameters()).dtype, None))
        wrapper.model = model
        self.model, self.wrapper = model, wrapper
        self.lm = HFLM(pretrained=wrapper, tokenizer=tok, batch_size=int(h.batch_size), max_length=int(cfg.model.max_seq_len))

    def __call__(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        try:
            return evaluate(self.lm, self.tasks, self.manager, self.limit)
        finally:
            self.model.train(was_training)


# ---------------------------------------------------------------------------------------- CLI
def _main(args: list[str]) -> str:
    from msar_train.export.hf import parse_options

    positional = [a for a in args if "=" not in a]
    if len(positional) != 2:
        raise InputError(f"expected OUT_DIR and TEXT_FILE, got {len(positional)} positional arguments")
    opts = parse_options([a for a in args if "=" in a], {"n": "40", "prefix": "msar_local", "seed": "0"}, "msar_train.export.harness")
    out, src = positional
    try:
        n, seed = int(opts["n"]), int(opts["seed"])
    except ValueError:
        raise InputError(f"n={opts['n']} seed={opts['seed']}: not integers") from None
    if n < 4:
        raise InputError(f"n={n}: must be >= 4")
    try:
        text = Path(src).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{src}: cannot read as UTF-8 text ({e})") from None
    names = write_local_tasks(out, text, n, opts["prefix"], seed)
    return (
        f"wrote {', '.join(names)} to {out}; run: lm_eval --model hf --model_args pretrained=OUT,trust_remote_code=True "
        f"--tasks {','.join(names)} --include_path {out}"
    )


def main(argv: list[str] | None = None) -> int:
    return run_cli("msar_train.export.harness", __doc__, argv, _main)


__all__ = ["HarnessRunner", "evaluate", "main", "scores", "task_manager", "write_local_tasks"]

if __name__ == "__main__":
    sys.exit(main())
