"""``msar-train -m ...``: Hydra multiruns, one training job per point of the sweep.

The sweep goes through Hydra's own machinery (``hydra.main`` with ``--multirun``), so launchers and
sweepers are Hydra plugins: the basic launcher runs the jobs one after another in this process;
``hydra/launcher=submitit_slurm`` (PyPI ``hydra-submitit-launcher``) sends each job to SLURM instead.
Sweep points come from the command line (``residual=vanilla,msar trainer.seed=1,2,3``) and/or from
an experiment config's ``hydra.sweeper.params`` (``configs/experiment/study_*.yaml``); the command
line wins for a key both give.

Each job trains in its own run dir, ``sweeps/<experiment.name>/<overrides>`` (``configs/train.yaml``,
``hydra.sweep``), with ``trainer.resume=auto`` as always: a job interrupted by a kill continues from
its last checkpoint when the sweep is run again. A finished job leaves a compact record
(``train/records.py``) in its run dir and, when ``experiment.records_dir`` is set, a copy there named
from its overrides; a job whose record exists (in either place) is skipped. A job that raises writes
a record with ``status: failed`` and the error (so a report can say which runs failed), and the sweep
goes on with the next job; Hydra then exits non-zero at the end. Delete a failed record to retry it.
SIGTERM / SIGINT stop the current job with a checkpoint (as for a single run) and end the sweep with
exit status 128 + the signal's number (143 / 130), so that a driver running several sweeps stops too.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from msar_train.config.store import short_name
from msar_train.errors import EXIT_BAD_INPUT, EXIT_CHECKPOINT_WRITE, CheckpointWriteError, ReportedElsewhere
from msar_train.train.checkpoint import atomic_write_text
from msar_train.train.records import RECORD, build_record, read_record, write_record
from msar_train.train.rundir import RunDirBusy

WALL_CLOCK = ".sweep_wall_s"  # seconds spent on a job by earlier, interrupted attempts


class SweepInterrupted(SystemExit):
    """End the whole sweep now (a stop signal, a bad config): a ``BaseException``, which Hydra's job
    runner does not catch; its code is the exit status."""


def records_dir(cfg: DictConfig) -> Path | None:
    from msar_train.data.io import repo_root

    rd = cfg.experiment.get("records_dir")
    if not rd:
        return None
    p = Path(rd)
    return p if p.is_absolute() else repo_root() / p


def record_paths(cfg: DictConfig, job_dir: Path, name: str) -> list[Path]:
    """Where this job's record lives: its run dir, and the experiment's records dir when set."""
    rd = records_dir(cfg)
    return [job_dir / RECORD] + ([rd / f"{name}.json"] if rd is not None else [])


def job_config(cfg: DictConfig, job_dir: Path, name: str) -> DictConfig:
    """The job's training config: resolved, validated, its run dir the job dir; the wandb group is the
    experiment and the run name the job's overrides, unless set."""
    from msar_train.config.validate import validate

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(cfg):
        cfg.trainer.run_dir = str(job_dir)
        cfg.logger.group = cfg.logger.group or cfg.experiment.name
        cfg.logger.name = cfg.logger.name or name
    OmegaConf.set_struct(cfg, True)
    validate(cfg)
    return cfg


def run_job(cfg: DictConfig, job_dir: Path, name: str, overrides: list[str], choices: dict[str, str]) -> dict | None:
    """Train one job unless its record exists; write its record. Returns the record (None: skipped)."""
    from msar_train.train.metrics import git_commit
    from msar_train.train.trainer import Trainer

    paths = record_paths(cfg, job_dir, name)
    done = next((p for p in paths if p.is_file()), None)
    if done is not None:
        print(f"msar-train: sweep job {name}: record {done} exists, skipping", flush=True)
        for p in paths:  # a record committed to records_dir but no run dir here (or the other way)
            if not p.is_file():
                write_record(read_record(done), p)
        return None
    try:
        cfg = job_config(cfg, job_dir, name)
    except ValueError as e:  # a bad config: every other job of the sweep most likely shares it
        print(f"msar-train: sweep job {name}: {e}", file=sys.stderr, flush=True)
        raise SweepInterrupted(2) from None
    print(f"msar-train: sweep job {name} -> {job_dir}", flush=True)
    # wall time over every attempt of the job (an interrupted job resumes in a later sweep)
    clock = job_dir / WALL_CLOCK
    t0 = time.perf_counter() - (float(clock.read_text()) if clock.is_file() else 0.0)
    status, error, world = "finished", None, 1
    try:
        trainer = Trainer(cfg)
        world = trainer.engine.dp_world
        result = trainer.fit()
    except (RunDirBusy, CheckpointWriteError, ReportedElsewhere) as e:  # transient: not the job's result, no record
        print(f"msar-train: sweep job {name}: {e}", file=sys.stderr, flush=True)
        code = e.code if isinstance(e, ReportedElsewhere) else EXIT_BAD_INPUT if isinstance(e, RunDirBusy) else EXIT_CHECKPOINT_WRITE
        raise SweepInterrupted(code) from None
    except Exception as e:  # noqa: BLE001 - recorded, then re-raised for Hydra's summary
        status, error = "failed", f"{type(e).__name__}: {e}"
        record = build_record(cfg, job_dir, name=name, overrides=overrides, choices=choices, wall_time_s=time.perf_counter() - t0,
                              world=world, status=status, error=error, git_commit=git_commit())  # fmt: skip
        for p in paths:
            write_record(record, p)
        raise
    if result.stopped_by_signal:
        atomic_write_text(clock, f"{time.perf_counter() - t0:.3f}")
        print(f"msar-train: sweep stopped by {result.stopped_by_signal} in job {name}; run the same command to resume", flush=True)
        raise SweepInterrupted(128 + signal.Signals[result.stopped_by_signal].value)  # a driver script sees the stop
    if not result.owns_loss:
        return None
    if result.steps < cfg.trainer.max_steps:  # trainer.stop_at: a time slice, not the end of the job
        atomic_write_text(clock, f"{time.perf_counter() - t0:.3f}")
        print(f"msar-train: sweep job {name} stopped at step {result.steps} of {cfg.trainer.max_steps} (trainer.stop_at); "
              "no record yet, the next sweep resumes it", flush=True)  # fmt: skip
        return None
    record = build_record(cfg, job_dir, name=name, overrides=overrides, choices=choices, wall_time_s=time.perf_counter() - t0,
                          world=world, git_commit=git_commit())  # fmt: skip
    for p in paths:
        write_record(record, p)
    val = record["final"]["val_loss"]
    print(f"msar-train: sweep job {name} finished: step {record['steps']} val/loss={val if val is None else round(val, 4)}", flush=True)
    return record


def _task(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    name = short_name(hc.job.override_dirname or "default")
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/") and isinstance(v, str)}
    run_job(cfg, Path(hc.runtime.output_dir), name, overrides, choices)


def multirun(args: list[str]) -> int:
    """Run ``args`` (Hydra overrides, sweeps included) as a Hydra multirun. Returns the exit status."""
    import hydra

    from msar_train.config.compose import config_dir
    from msar_train.config.store import register_schemas

    register_schemas()
    main = hydra.main(config_path=str(config_dir()), config_name="train", version_base="1.3")(_task)
    argv = sys.argv
    sys.argv = [argv[0] if argv else "msar-train", "--multirun", *args]
    try:
        main()
    except SweepInterrupted as e:
        return int(e.code or 0)
    except SystemExit as e:  # Hydra exits 1 after printing a failed job's error
        return 1 if e.code is None else int(e.code) if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    return 0
