"""``msar-train [hydra overrides]``: compose the config and train (single process).

Examples: ``msar-train residual=attnres model=tiny trainer.max_steps=30``;
``msar-train --cfg residual=msar_m2`` prints the composed config and exits;
``msar-train -m residual=vanilla,msar trainer.seed=1,2,3`` runs a Hydra multirun (one job per point,
run dirs under ``sweeps/<experiment.name>/``; finished jobs are skipped; ``experiment=study_backends``
runs a whole study: see ``train/sweep.py``).

Exit status (``msar_train/errors.py``): 0 done (also after SIGTERM / SIGINT: the step finishes and a
checkpoint is saved); 2 bad input: a config field, a data file, a checkpoint, a run dir in use (one line
naming the field or file); 3 halted after ``trainer.max_consecutive_skips`` consecutive non-finite steps;
4 a checkpoint could not be written (the previous one is intact); anything else is a bug and prints its
traceback. ``MSAR_DEBUG=1`` shows tracebacks for every error. In a multi-rank run the rank that finds an
error prints it; the others exit without a message of their own.
"""

from __future__ import annotations

import os
import sys

from omegaconf import OmegaConf

from msar_train.errors import EXIT_BAD_INPUT, EXIT_CHECKPOINT_WRITE, EXIT_HALTED, CheckpointWriteError, InputError, ReportedElsewhere, debug


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

    result = run_trainer(cfg)
    if isinstance(result, int):
        return result
    from msar_train.parallel.engine import shutdown_distributed

    shutdown_distributed()
    if result.owns_loss and result.stopped_by_signal:
        print(f"stopped by {result.stopped_by_signal} after step {result.steps}; checkpoint saved, continue with trainer.resume=auto")
    if result.owns_loss:
        val = "n/a" if result.val_loss is None else f"{result.val_loss:.4f}"
        train = "n/a" if result.train_loss is None else f"{result.train_loss:.4f}"
        print(f"final step={result.steps} train/loss={train} val/loss={val}")
        print(f"run dir: {result.run_dir}")
    return 0


def _rank() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"rank {os.environ.get('RANK', '?')}: " if world > 1 else ""


def _lost_peer(err: BaseException) -> bool:
    """A collective that failed because another rank went away (it exited after its own error)."""
    import torch.distributed as tdist

    if int(os.environ.get("WORLD_SIZE", "1") or 1) < 2:
        return False
    markers = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout", "timed out")
    return isinstance(err, getattr(tdist, "DistError", ())) or (isinstance(err, RuntimeError) and any(m in str(err) for m in markers))


def run_trainer(cfg):
    """``Trainer(cfg).fit()``; an error of the documented kinds becomes one line on stderr and its exit code."""
    from msar_train.train.trainer import Trainer, TrainingHalted

    codes = (
        (InputError, EXIT_BAD_INPUT, ""),
        (TrainingHalted, EXIT_HALTED, "training halted: "),
        (CheckpointWriteError, EXIT_CHECKPOINT_WRITE, ""),
    )
    try:
        return Trainer(cfg).fit()
    except ReportedElsewhere as e:
        if debug():
            raise
        return e.code
    except Exception as e:
        if debug():
            raise
        for kind, code, prefix in codes:
            if isinstance(e, kind):
                first, *rest = str(e).splitlines() or [""]
                print(f"msar-train: {_rank()}{prefix}{first}", *rest, sep="\n", file=sys.stderr, flush=True)
                return code
        if _lost_peer(e):
            why = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            print(f"msar-train: {_rank()}stopped: another rank ended ({why}); its message says why", file=sys.stderr, flush=True)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
