"""Stop 51: what ``ampguard.module_hooks.Hook`` adds to one hook call (a no-op forward hook called directly and
through ``Hook``; min of 5 repeats of 200,000 calls, three runs). Run: PYTHONPATH=$PWD python
benchmarks/results/cpu_stop51/hook_call.py"""

from __future__ import annotations

import timeit

import torch

from ampguard.module_hooks import Hook


def noop(module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
    return None


def main() -> None:
    hook = Hook(noop)
    module, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    n = 200_000
    for _ in range(3):
        direct = min(timeit.repeat(lambda: noop(module, (x,), x), number=n, repeat=5)) / n * 1e9
        through = min(timeit.repeat(lambda: hook(module, (x,), x), number=n, repeat=5)) / n * 1e9
        print(f"direct {direct:.0f} ns, through Hook {through:.0f} ns, added {through - direct:.0f} ns a hook call")


if __name__ == "__main__":
    main()
