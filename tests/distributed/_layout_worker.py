"""``[torchrun ...] _layout_worker.py OUT_DIR [overrides]``: train like ``msar-train``, then let the layout
evaluate one fixed batch and keep its logits (never collected by pytest).

After ``Trainer.fit()`` every rank evaluates the first validation batch of its data-parallel rank through
its own engine (``Engine.eval_loss``: the plain engine, the pipeline, the interleaved pipeline, with
experts dispatched over the expert-parallel group). Each rank that computes logits (the last stage of a
pipeline, every rank otherwise) writes ``OUT_DIR/logits_rank{RANK}.pt = {"ids", "logits", "step"}``;
tests/distributed/test_layouts.py compares them with the consolidated single-process model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch


def main() -> None:
    from msar_train.config import compose_config
    from msar_train.parallel.engine import shutdown_distributed
    from msar_train.train.trainer import Trainer

    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(compose_config(overrides))
    trainer.fit()
    engine = trainer.engine
    loss_fn = engine.loss_fn
    captured: list[torch.Tensor] = []

    class Capturing(type(loss_fn)):
        def __call__(self, outputs, labels_BT):
            captured.append(outputs[0].detach().clone())
            return super().__call__(outputs, labels_BT)

    loss_fn.__class__ = Capturing
    batch = trainer.data.val.batch_at(0, 0)
    engine.eval_loss([batch])
    if captured:
        rank = int(os.environ.get("RANK", "0"))
        torch.save({"ids": batch.input_ids_BT, "logits": captured[0], "step": trainer.step}, out / f"logits_rank{rank}.pt")
    # As msar-train does: end the gloo groups on every rank together, not in the interpreter's exit
    # (where a rank now and then aborts with "terminate called without an active exception").
    shutdown_distributed()


if __name__ == "__main__":
    main()
