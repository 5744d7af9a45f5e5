"""Stop 53: one torchao float8 cast on the CPU, as torchao calls it, without the monitor's taps, through them passed
through (no layer of its registered), and taken (a grad_output of a registered layer, to a monitor that keeps
nothing). Best of 5 repeats of 3000 calls, in microseconds a call.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/results/cpu_stop53/cast_micro.py
"""
import sys
import timeit
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
warnings.filterwarnings("ignore")
import torch  # noqa: E402
from torchao.float8 import float8_linear  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig  # noqa: E402

from ampguard import fp8 as F  # noqa: E402

torch.set_num_threads(1)
x = torch.randn(8, 64)
cfg = LinearMMConfig()
N = 3000


def call() -> object:
    return float8_linear.hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, cfg,
                                                     gemm_input_role=GemmInputRole.GRAD_OUTPUT)


def taken() -> object:
    F._TAPS.last_grad = None  # each call a new grad_output tensor, as far as the taps can tell
    return call()


class _Keeper:
    def _took(self, *args: object) -> None:
        pass


def best(fn) -> float:  # type: ignore[no-untyped-def]
    for _ in range(200):
        fn()
    return min(timeit.repeat(fn, number=N, repeat=5)) / N * 1e6


print(f"torchao's cast                {best(call):6.2f} us")
F._TAPS.install()
try:
    print(f"through the taps, passed      {best(call):6.2f} us")
    F._TAPS.owners[id(cfg)] = (cfg, [(_Keeper(), 0)])
    print(f"through the taps, taken       {best(taken):6.2f} us")
finally:
    F._TAPS.owners.pop(id(cfg), None)
    F._TAPS.remove()
