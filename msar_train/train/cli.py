"""``msar-train [hydra overrides]``: compose the config and train (single process).

Examples: ``msar-train residual=attnres model=tiny trainer.max_steps=30``;
``msar-train --cfg residual=msar_m2`` prints the composed config and exits;
``msar-train -m residual=vanilla,msar trainer.seed=1,2,3`` runs a Hydra multirun (one job per point,
run dirs under ``sweeps/<experiment.name>/``; finished jobs are skipped; ``experiment=study_backends``
runs a whole study: see ``train/sweep.py``).

Exit status: 0 done (also after SIGTERM / SIGINT: the step finishes and a checkpoint is saved);
2 bad config or unusable checkpoint (the message names the field or file); 3 halted after
``trainer.max_consecutive_skips`` consecutive non-finite steps.
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # Launchers (deepspeed) may append --local_rank=N; it is read from the environment instead.
    args = [a for a in args if not a.startswith("--local_rank")]
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    if "-m" in args or "--multirun" in args:
        from msar_train.train.sweep import multirun

        return multirun([a for a in args if a not in ("-m", "--multirun")])
    show_cfg = "--cfg" in args
    args = [a for a in args if a != "--cfg"]

    from msar_train.config import compose_config

    try:
        cfg = compose_config(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"msar-train: {e}", file=sys.stderr)
        return 2
    if show_cfg:
        print(OmegaConf.to_yaml(cfg))
        return 0

    from msar_train.train.checkpoint import CheckpointError
    from msar_train.train.trainer import Trainer, TrainingHalted

    try:
        result = Trainer(cfg).fit()
    except CheckpointError as e:
        print(f"msar-train: checkpoint error: {e}", file=sys.stderr)
        return 2
    except TrainingHalted as e:
        print(f"msar-train: training halted: {e}", file=sys.stderr)
        return 3
    if result.owns_loss and result.stopped_by_signal:
        print(f"stopped by {result.stopped_by_signal} after step {result.steps}; checkpoint saved, continue with trainer.resume=auto")
    if result.owns_loss:
        val = "n/a" if result.val_loss is None else f"{result.val_loss:.4f}"
        train = "n/a" if result.train_loss is None else f"{result.train_loss:.4f}"
        print(f"final step={result.steps} train/loss={train} val/loss={val}")
        print(f"run dir: {result.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
