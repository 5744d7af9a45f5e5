"""``python -m ampguard.runlog RUN_DIR_OR_EVENTS.jsonl ...``: the ``ampguard report`` command."""

import sys

from .command import report_main

sys.exit(report_main())
