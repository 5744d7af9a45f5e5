"""Stop 63: which tensors made inside a framework's training step outlive it (CPU, no device needed).

Stop 62's ``fw_graph_keys.txt`` (an H100): inside the transformers Trainer the guard's gradient measurement never
replays its CUDA graph, because the 98 small gradients (below 1 MiB: the caching allocator's small pool) take 21
places, in a cycle of 18 steps; in accelerate's loop and Lightning's they settle after three steps. A gradient's
place is where the allocator's best fit puts it when backward makes it, which depends on the small blocks alive at
that moment: a small tensor that lives across steps, made at one step and let go some steps later, shifts the
places of everything allocated around it until it goes.

The CPU has no caching allocator, but it shows the lifetimes: this runs a framework's arm of
``benchmarks/frameworks_cost.py`` under a ``TorchDispatchMode`` that keeps a weak reference to the storage of every
op's output, with the step that made it, and at the end of each optimizer step lists the storages made at an
earlier step (from step 3 on: the optimizer state is made at step 1) that are still alive. Diagnosis only: nothing
is asserted. For example:

    PYTHONPATH=$PWD python benchmarks/results/cpu_stop63/survivors.py --frameworks transformers,accelerate --steps 40
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
import tempfile
import traceback
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import frameworks_cost as fc


class Lifetimes(TorchDispatchMode):
    """Every op output's storage, weakly, with the step that made it, its op, its size and where in Python."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.made: dict[int, tuple[weakref.ref[Any], int, str, int, str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                try:
                    s = t.untyped_storage()
                except Exception:  # a tensor subclass without storage: not a block
                    continue
                key = id(s)
                if key in self.made and self.made[key][0]() is s:
                    continue  # an in-place op or a view: the storage was made earlier
                where = "".join(f"{Path(f.filename).name}:{f.lineno} {f.name} < " for f in
                                reversed(traceback.extract_stack(limit=14)[:-2]) if "torch/" not in f.filename
                                and "survivors" not in f.filename)[:-3]
                self.made[key] = (weakref.ref(s), self.step, str(func), s.nbytes(), where[:300])
        return out

    def alive_from_before(self, first: int) -> list[tuple[int, str, int, str]]:
        rows = []
        for key, (ref, step, op, nbytes, where) in list(self.made.items()):
            if ref() is None:
                del self.made[key]
            elif first <= step < self.step:
                rows.append((step, op, nbytes, where))
        return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default="transformers,accelerate,lightning")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--plain", action="store_true", help="the framework's plain arm, not the guarded one")
    args = ap.parse_args()
    device = torch.device("cpu")
    size = fc.SIZES["tiny"]
    base = fc.build_model(size, device)
    total = args.steps + 4
    ctx: dict[str, Any] = {"device": device, "size": size, "tmpdir": tempfile.mkdtemp(prefix="ampguard-surv-"),
                           "total_steps": total, "dataset": fc.Tokens(total * size["batch"], size)}
    print(f"cpu, torch {torch.__version__}, GPT-2 tiny, {args.steps} {'plain' if args.plain else 'guarded'} steps")
    for framework in [f.strip() for f in args.frameworks.split(",") if f.strip()]:
        if framework.startswith(("accelerate", "transformers")):
            fc._fresh_accelerate_state()
        arm = fc.Arm(f"{framework}_{'plain' if args.plain else 'guarded'}", framework, not args.plain,
                     args.steps, device)
        fc.BUILDERS[framework](arm, copy.deepcopy(base), ctx)
        mode = Lifetimes()
        ages: collections.Counter[int] = collections.Counter()
        kept: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
        done = arm.step_done

        def step_done(mode: Lifetimes = mode, done: Any = done, ages: collections.Counter[int] = ages,
                      kept: dict[tuple[str, str], list[int]] = kept) -> bool:
            mode.step += 1
            if mode.step >= 4:
                for made, op, nbytes, where in mode.alive_from_before(3):
                    ages[mode.step - made] += 1
                    kept[(op, where)].append(nbytes)
            return done()

        arm.step_done = step_done  # type: ignore[method-assign]
        body = arm.body

        def in_mode(a: fc.Arm, body: Any = body, mode: Lifetimes = mode) -> None:
            with mode:
                body(a)

        arm.body = in_mode
        arm.run_block()
        arm.end()
        if arm.error:
            print(f"\n{framework}: failed\n{arm.error}")
            continue
        print(f"\n{framework}: {mode.step} steps; storages made at step 3 or later and alive at a later step's end, "
              f"by age in steps: {dict(sorted(ages.items()))}")
        for (op, where), sizes in sorted(kept.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(sizes):4d} x {op} ({sizes[0]} bytes): {where}")


if __name__ == "__main__":
    main()
