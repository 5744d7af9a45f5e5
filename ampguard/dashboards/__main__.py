"""``python -m ampguard.dashboards [out_dir]``: write the dashboard, rules and rule tests with the
defaults (``out_dir``: ``dashboards``) and print their paths."""

import sys

from . import write_all

for p in write_all(sys.argv[1] if len(sys.argv) > 1 else "dashboards"):
    print(p)
