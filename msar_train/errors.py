"""What a failed run means to its user: the exception types the CLIs turn into one line and an exit code.

Exit codes (README "Checkpoints, resume and faults"):

    0  done (also after SIGTERM / SIGINT: the step finishes and a checkpoint is saved)
    2  bad input: a config field, a data file, a checkpoint, a CLI flag, a run dir in use
    3  halted: ``trainer.max_consecutive_skips`` non-finite steps in a row
    4  a checkpoint could not be written (disk full, I/O error, permission); the previous one is intact
    other  a bug: the traceback is printed

``MSAR_DEBUG=1`` makes the CLIs re-raise instead, so the traceback of an input error is shown too.
No torch import here: ``config/`` and ``data/`` raise these.
"""

from __future__ import annotations

import os

EXIT_BAD_INPUT = 2
EXIT_HALTED = 3
EXIT_CHECKPOINT_WRITE = 4
DEBUG_ENV = "MSAR_DEBUG"


class InputError(ValueError):
    """Bad user input found while running; the message names the field or the file."""


class ConfigError(InputError):
    """A config field with a value it cannot have; the message starts with ``field=value``."""


class CheckpointWriteError(RuntimeError):
    """Saving a checkpoint failed for an OS reason; the message names the step, the path, the OS error
    and the last valid checkpoint."""


class ReportedElsewhere(RuntimeError):
    """Another rank found the error and printed it; this rank exits with ``code`` and no message of its own."""

    def __init__(self, code: int):
        super().__init__(f"another rank failed (exit {code}); its message says why")
        self.code = code


def debug() -> bool:
    """``MSAR_DEBUG`` set to anything but empty or 0: show tracebacks of input errors too."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_cli(prog: str, doc: str | None, argv: list[str] | None, body) -> int:
    """The frame of the ``key=value`` console scripts: ``--help`` prints ``doc`` (exit 0; no arguments
    at all: the same text, exit 2); else ``body(args)`` returns the text to print (exit 0), and an
    ``InputError`` becomes one line ``<prog>: error: ...`` with exit 2 (re-raised under ``MSAR_DEBUG``)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(doc)
        return 0 if args else EXIT_BAD_INPUT
    try:
        text = body(args)
    except InputError as e:
        if debug():
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(text)
    return 0
