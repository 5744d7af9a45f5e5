"""``benchmarks/digest_variants.py``: each variant of the replica digest is what its kind says on the CPU. A ``same``
variant gives ``params_digest``'s two words bit for bit, a ``low32`` one those words modulo 2**32, and every variant
changes when one bit of one element flips (through an integer view, as a fault would)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ampguard import fingerprint as F

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("digest_variants_bench", REPO / "benchmarks" / "digest_variants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(64, 96, generator=g),
        torch.randn(300, generator=g).to(torch.bfloat16),
        torch.randn(7, 5, generator=g).to(torch.float16),
        torch.randn(1001, generator=g),  # odd length: a word's trailing element
        torch.randn(2051, generator=g)[1:],  # starts off an 8-byte boundary: leading elements
        torch.randn(3, generator=g, dtype=torch.float64),
        torch.randn(6, 10, generator=g).t(),  # not contiguous: read through a copy, which must not be kept
    ]


def _cpu_variants(bench) -> list[str]:
    return [name for name, v in bench.VARIANTS.items() if not v.cuda]


@pytest.mark.parametrize(
    ("chunk", "small"),
    [(F._CHUNK, 1 << 16), (1 << 10, 500)],  # one chunk a width, all packed; several chunks with tails, some not
)
def test_equivalent_variants_match_params_digest(bench, monkeypatch, chunk, small) -> None:
    monkeypatch.setattr(F, "_CHUNK", chunk)
    monkeypatch.setattr(bench, "_SMALL", small)
    ts = _tensors()
    reference = F.params_digest(ts)
    checked = []
    for name in _cpu_variants(bench):
        if bench.VARIANTS[name].kind in ("same", "low32"):
            bench.check(name, bench.VARIANTS[name].fn(ts), reference)
            checked.append(name)
    assert {"main", "before", "widen", "compiled", "int32wrap"} <= set(checked)


def _flip(t: torch.Tensor, k: int, b: int) -> None:
    ints = t.view(torch.int32 if t.element_size() == 4 else torch.int16)
    bits = 8 * ints.element_size()
    ints[tuple(int(i) for i in np.unravel_index(k, ints.shape))] ^= (1 << b) - (
        1 << bits if b == bits - 1 else 0
    )  # the sign bit as a negative value of the width


@pytest.mark.parametrize(
    ("index", "k", "b"),
    [
        (0, 0, 0),
        (0, 4000, 31),
        (1, 299, 15),
        (2, 34, 15),
        (3, 999, 31),
        (3, 1000, 7),
        (4, 0, 3),
        (4, 2049, 22),
        (6, 13, 30),
    ],
)
def test_every_variant_sees_a_flipped_bit(bench, index, k, b) -> None:
    ts = _tensors()
    names = _cpu_variants(bench)
    assert {"tensors", "pairs"} <= {n for n in names if bench.VARIANTS[n].kind == "different"}
    before = {name: bench.VARIANTS[name].fn(ts).clone() for name in names}
    _flip(ts[index], k, b)
    for name in names:
        assert not torch.equal(bench.VARIANTS[name].fn(ts), before[name]), name


def test_pairs_sees_a_swap_within_a_word(bench) -> None:
    ts = _tensors()
    before = bench.VARIANTS["pairs"].fn(ts).clone()
    flat = ts[3].view(-1)
    flat[10], flat[11] = flat[11].clone(), flat[10].clone()
    assert not torch.equal(bench.VARIANTS["pairs"].fn(ts), before)


def test_a_variant_that_differs_from_main_is_reported_not_fatal(bench, monkeypatch, capsys) -> None:
    wrong = bench.Variant(lambda ts: torch.zeros(2, dtype=torch.int64), "same")
    monkeypatch.setitem(bench.VARIANTS, "widen", wrong)
    out = bench.main(["--device", "cpu", "--model", "mlp-small", "--reps", "3", "--variants", "main,widen,int32wrap"])
    assert set(out["failed"]) == {"widen"} and set(out["ms"]) == {"main", "int32wrap"}
    assert "FAILED widen: AssertionError" in capsys.readouterr().out
