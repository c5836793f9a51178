"""``python -m msar_train.train`` / ``deepspeed --module msar_train.train``: same as ``msar-train``."""

import sys

from msar_train.train.cli import main

sys.exit(main())
