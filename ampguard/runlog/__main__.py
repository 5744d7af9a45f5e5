"""``python -m ampguard.runlog RUN_DIR_OR_EVENTS.jsonl ...``: the ``ampguard report`` command."""

import sys

from .command import report_main

if __name__ == "__main__":
    sys.exit(report_main())
