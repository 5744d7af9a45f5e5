"""Which kernels one variant of a ``table.py --out`` run launches beyond another, per step, by kernel name (the
profile's ``kernels_by_name_per_step``: every kernel, since stop 64). Stop 64 counted the sentinel's guard at +43
kernels and +0.17 ms of kernel time a step over the default guard (GPT-2 124M b8, H100) without the names.

    python benchmarks/results/cpu_stop64/kernel_diff.py RUN.json [VARIANT BASELINE]

VARIANT and BASELINE default to guard_sentinel_fused and guard_fused."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    path = argv[0]
    variant, baseline = (argv[1], argv[2]) if len(argv) >= 3 else ("guard_sentinel_fused", "guard_fused")
    with open(path) as f:
        data = json.load(f)
    # table.py --out: {"meta", "groups": {group: {"variants": {name: {"profile": ...}}}}} (the first group holding
    # both variants; stop 65: this read a top-level "variants", which table.py never wrote)
    runs = next(g["variants"] for g in data["groups"].values()
                if variant in g["variants"] and baseline in g["variants"])
    a = runs[variant]["profile"]["kernels_by_name_per_step"]
    b = runs[baseline]["profile"]["kernels_by_name_per_step"]
    rows = []
    for name in set(a) | set(b):
        (ca, ta), (cb, tb) = a.get(name, [0, 0.0]), b.get(name, [0, 0.0])
        if abs(ca - cb) > 1e-9 or abs(ta - tb) > 0.5:
            rows.append((ta - tb, ca - cb, ca, ta, name))
    rows.sort(key=lambda r: -abs(r[0]))
    print(f"{variant} over {baseline}, per step: kernels {sum(r[1] for r in rows):+.1f}, "
          f"kernel time {sum(r[0] for r in rows):+.1f} us")
    print(f"{'d us':>8} {'d count':>8} {'count':>7} {'us':>8}  kernel")
    for dt, dc, c, t, name in rows[:40]:
        print(f"{dt:+8.1f} {dc:+8.1f} {c:7.1f} {t:8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
