"""Variants of the replica digest (``ampguard.fingerprint.params_digest``), timed alone on one model's
parameters: which one reads the bits fastest (issue 27: the digest at N=100 must cost at most 0.1 % of a step,
about 2.5 ms for GPT-2 124M on an H200).

Each variant is a function of the parameter list that returns a digest, of one of three kinds (``Variant.kind``):
``same``, the two int64 words of ``main`` bit for bit (asserted at warm-up); ``low32``, ``main``'s two words
modulo 2**32 (asserted); ``different``, another fingerprint (what it sees is in its docstring).

- ``before``: the digest before its plan (chunks of ``_CHUNK`` elements, each reduced and weighted on its own:
  about 14 kernels a chunk, launch-bound on a GPU). same;
- ``main``: ``params_digest`` on main, the reference: since run ``f``, ``widen``'s arithmetic, the plan checked
  by a host-only key, and on CUDA its kernels replayed from a CUDA graph captured on the first call;
- ``summed``: ``main`` as it was at run ``f`` (a plan made once per parameter list, its check making a view of
  every tensor; per chunk its concatenation and two reductions; the weights applied once to all row and column
  sums), eagerly. same;
- ``tensors``: no concatenation: each tensor summed on its own (the per-parameter fingerprints, folded). different;
- ``widen``: ``main``, but each chunk widened to int64 once (the concatenation written straight into int64) and
  both reductions read that: ``sum(dtype=torch.int64)`` of an int32 tensor first copies it to int64
  (``make_reduction``'s ``self.to(in_dtype)``), so ``main`` widens every element twice. same;
- ``int32wrap``: ``main``'s plan, the sums accumulated in int32 (no widening copy for fp32; 16-bit views still
  widen). low32;
- ``pairs``: ``main`` over the bits read as int64 words (two fp32 or four bf16 elements a word; no widening copy,
  half or a quarter of the elements). different;
- ``compiled``: each tensor's plain and position-weighted sums in one ``torch.compile``d function (inductor reads
  each int view once, widens in registers and fuses both sums), folded with the tensors' offsets. same;
- ``graph``, ``graph_widen``, ``graph_pairs``, ``compiled_graph``: ``summed``, ``widen``, ``pairs``, ``compiled``
  captured once in a CUDA graph and replayed (no launches, no plan lookup; the output in a static tensor). CUDA only.

``setup`` is each variant's first call (plan, compile or capture), outside the timed reps; ``+reserved`` what that
left reserved on the device (a graph's pool keeps its temporaries). ``main: _plan lookup`` is the host time of the
plan check alone, which every call of ``main``, ``widen`` and ``int32wrap`` pays.

Run ``a`` (2026-12-04) timed the first version's larger chunks and a row-sums-only variant instead; see
benchmarks/RESULTS.md.

    python benchmarks/digest_variants.py --device cuda --model gpt2 --reps 30 --out digest.json
    python benchmarks/digest_variants.py --device cuda --variants main,compiled,compiled_graph
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import overhead

from ampguard import fingerprint as F

Digest = Callable[[Sequence[torch.Tensor]], torch.Tensor]


def _before(tensors) -> torch.Tensor:
    """``params_digest`` as it was before its plan (commit c158234): per chunk, a concatenation, ``_sums`` (row and
    column sums, weighted there) and the offset folded in, about 14 kernels a chunk."""
    device = tensors[0].device
    by_width: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        x = F._ints(t).reshape(-1).to(device)
        by_width.setdefault(x.dtype, []).append(x)
    plain = torch.zeros((), dtype=torch.int64, device=device)
    weighted = torch.zeros((), dtype=torch.int64, device=device)
    offset = 0
    for dtype in sorted(by_width, key=str):
        pending: list[torch.Tensor] = []
        size = 0
        chunks: list[torch.Tensor] = []
        for x in by_width[dtype]:
            if x.numel() >= F._CHUNK:
                if pending:
                    chunks.append(torch.cat(pending))
                    pending, size = [], 0
                chunks.append(x)
                continue
            pending.append(x)
            size += x.numel()
            if size >= F._CHUNK:
                chunks.append(torch.cat(pending))
                pending, size = [], 0
        if pending:
            chunks.append(torch.cat(pending))
        for chunk in chunks:
            s = F._sums(chunk)
            plain = plain + s[0]
            weighted = weighted + s[1] + offset * s[0]
            offset += chunk.numel()
    return torch.stack([plain, weighted])


class _PerList:
    """The last value of ``make(tensors)``, kept while ``F._key(tensors)`` is unchanged, and only when its views are
    the tensors' own (``F._viewable``: ``_ints`` copies the others)."""

    def __init__(self, make: Callable[[Sequence[torch.Tensor]], object]) -> None:
        self.make = make
        self.key: tuple | None = None
        self.value: object = None

    def __call__(self, tensors: Sequence[torch.Tensor]) -> object:
        key = F._key(tensors)
        if key != self.key:
            self.key, self.value = None, self.make(tensors)
            if F._viewable(key):
                self.key = key
        return self.value


def _ordered(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The flat integer views in ``main``'s order: grouped by width (``sorted(str(dtype))``), in order within one."""
    return [v for group in F._by_width([F._ints(t).reshape(-1) for t in tensors], tensors[0].device) for v in group]


def _matrices(plan: F._Plan, join: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]) -> Iterator[torch.Tensor]:
    """``params_digest``'s loop over its plan's blocks: each block's ``[rows, cols]`` matrix, read from
    ``join(parts)``, made once for a chunk's rows and its tail."""
    joined: tuple[tuple[torch.Tensor, ...], torch.Tensor] | None = None
    for block in plan.blocks:
        if joined is None or joined[0] is not block.parts:
            joined = (block.parts, join(block.parts))
        yield joined[1][block.start : block.start + block.rows * block.cols].view(block.rows, block.cols)


def _cat(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _cat64(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The chunk widened to int64 in one kernel: a lone tensor ``.to``, several concatenated into an int64 buffer."""
    if len(parts) == 1:
        return parts[0].to(torch.int64)
    n = sum(x.numel() for x in parts)
    return torch.cat(parts, out=torch.empty(n, dtype=torch.int64, device=parts[0].device))


def _widen(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``main``'s plan and arithmetic, each chunk widened to int64 once. ``main`` reduces an int32 chunk twice with
    ``sum(dtype=torch.int64)``, and each of those first copies the chunk to int64 (``make_reduction``:
    ``self.to(in_dtype)``): per element 4 + 2 x (4 read, 8 written, 8 read) bytes, after the concatenation's
    4 + 4. Here the concatenation is written straight into an int64 buffer (``torch.cat(out=)``; a lone tensor:
    ``.to(torch.int64)``) and both sums read it: 4 + 8 + 8 + 8. Bitwise-equivalent to ``main``: the same integers
    summed modulo 2**64."""
    if not tensors:
        return torch.zeros(F.WORDS, dtype=torch.int64)
    plan = F._plan(tensors, tensors[0].device)
    if not plan.blocks:
        return torch.zeros(F.WORDS, dtype=torch.int64, device=tensors[0].device)
    row_sums: list[torch.Tensor] = []
    col_sums: list[torch.Tensor] = []
    for m in _matrices(plan, _cat64):  # one chunk's int64 copy alive at a time
        row_sums.append(m.sum(1))
        col_sums.append(m.sum(0))
    rows, cols = torch.cat(row_sums), torch.cat(col_sums)
    return torch.stack([rows.sum(), (rows * plan.row_weights).sum() + (cols * plan.col_weights).sum()])


_WEIGHTS32: dict[int, tuple[F._Plan, torch.Tensor, torch.Tensor]] = {}


def _row_col_sums(plan: F._Plan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """All row sums and all column sums of a plan's blocks, each chunk concatenated in its own width and reduced
    with ``sum(dtype=dtype)``."""
    row_sums: list[torch.Tensor] = []
    col_sums: list[torch.Tensor] = []
    for m in _matrices(plan, _cat):
        row_sums.append(m.sum(1, dtype=dtype))
        col_sums.append(m.sum(0, dtype=dtype))
    return torch.cat(row_sums), torch.cat(col_sums)


def _int32wrap(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``main``'s plan and arithmetic in int32, wrapping: the row and column sums ``sum(dtype=torch.int32)`` (an
    int32 view is read as it is, no widening copy; an int16 view is still copied to int32), the weights taken
    modulo 2**32. ``[2]`` int32: ``main``'s two words modulo 2**32 (``low32`` kind, asserted at warm-up: integer
    sums and products wrap the same way in any order). A 32-bit fingerprint: a flipped bit changes an element by
    +-2**b, b < 32, so the plain word always changes; a swap of elements i, j changes the weighted word by
    (i - j)(x_j - x_i), unseen when that is a multiple of 2**32 (``main``'s 64 bits see every swap of unequal
    elements of up to 32 bits among fewer than 2**31 positions)."""
    if not tensors:
        return torch.zeros(F.WORDS, dtype=torch.int32)
    plan = F._plan(tensors, tensors[0].device)
    if not plan.blocks:
        return torch.zeros(F.WORDS, dtype=torch.int32, device=tensors[0].device)
    w = _WEIGHTS32.get(id(plan))
    if w is None or w[0] is not plan:
        _WEIGHTS32.clear()
        # int64 -> int32 keeps the low 32 bits (two's complement): the weights modulo 2**32
        w = _WEIGHTS32[id(plan)] = (plan, plan.row_weights.to(torch.int32), plan.col_weights.to(torch.int32))
    rows, cols = _row_col_sums(plan, torch.int32)
    weighted = (rows * w[1]).sum(dtype=torch.int32) + (cols * w[2]).sum(dtype=torch.int32)
    return torch.stack([rows.sum(dtype=torch.int32), weighted])


def _words(v: torch.Tensor) -> list[torch.Tensor]:
    """A flat integer view of width < 8 as views only: the leading elements before an 8-byte boundary, the int64
    words (``view(torch.int64)``), the trailing elements after the last whole word."""
    width = v.element_size()
    if width >= 8 or v.numel() == 0:
        return [v]
    per = 8 // width
    lead = min(v.numel(), ((-v.data_ptr()) % 8) // width)
    body = (v.numel() - lead) // per * per
    pieces = [v[:lead], v[lead : lead + body].view(torch.int64), v[lead + body :]]
    return [x for x in pieces if x.numel()]


_pair_views = _PerList(lambda ts: [w for v in _ordered(ts) for w in _words(v)])


def _pairs(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``main`` (``params_digest``) over the bits read as int64 words: each fp32 tensor as pairs of elements, each
    bf16/fp16 tensor as quads (``view(torch.int64)``, no copy), the few elements before an 8-byte boundary or after
    the last whole word kept as they are. No widening copy and a half (fp32) or a quarter (16-bit) of the
    elements to reduce. A different fingerprint: a flipped bit b of a word's element h changes the word by
    +-2**(b + 32h) (fp32), nonzero modulo 2**64, so the plain word always changes; a swap within a word changes
    it (``lo + 2**32 hi`` against ``hi + 2**32 lo``: they differ by (hi - lo)(2**32 - 1), 2**32 - 1 odd). The
    weighted word is weaker than ``main``'s: swapping two high halves (odd fp32 positions) i, j words apart
    changes it by (i - j)(d)2**32, unseen when (i - j) d is a multiple of 2**32 (e.g. fp32 values with 16 zero low
    mantissa bits, as bf16-rounded ones, 2**16 words apart); swaps of low halves, or of whole words whose low
    halves differ, are always seen. The view list is kept per parameter list (storage unchanged)."""
    if not tensors:
        return torch.zeros(F.WORDS, dtype=torch.int64)
    return F.params_digest(_pair_views(tensors))  # type: ignore[arg-type]


_SMALL = 1 << 16
"""Tensors of fewer elements are concatenated for ``compiled`` (GPT-2: ~100 of its 148 tensors, ~0.1 % of its
elements): one reduction for all of them, not a kernel each, and a smaller graph to compile."""


class _Packed(NamedTuple):
    """What ``compiled`` reads for one list of tensors, made once per list (``_PerList``)."""

    big: list[torch.Tensor]
    """The flat integer views of ``_SMALL`` elements or more, in ``main``'s order."""
    offsets: torch.Tensor
    """Each big view's offset in that order, int64: its element k is at position offset + k + 1."""
    small: tuple[torch.Tensor, ...]
    """The other views, concatenated at each call (``torch.cat`` promotes int16 to int32 or int64: the same values)."""
    positions: torch.Tensor | None
    """The small views' elements' positions in that order, int64, laid out as their concatenation."""


def _pack(tensors: Sequence[torch.Tensor]) -> _Packed:
    device = tensors[0].device
    big: list[torch.Tensor] = []
    offsets: list[int] = []
    small: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    start = 0
    for v in _ordered(tensors):
        n = v.numel()
        if n >= _SMALL:
            big.append(v)
            offsets.append(start)
        elif n:
            small.append(v)
            positions.append(torch.arange(start + 1, start + n + 1, dtype=torch.int64, device=device))
        start += n
    return _Packed(big, torch.tensor(offsets, dtype=torch.int64, device=device), tuple(small),
                   torch.cat(positions) if positions else None)


_packed = _PerList(_pack)


def _digest_sums(
    big: list[torch.Tensor], offsets: torch.Tensor, small: torch.Tensor | None, positions: torch.Tensor | None
) -> torch.Tensor:
    """The two words from :class:`_Packed`'s parts (``small``: the small views concatenated). Compiled."""
    plains: list[torch.Tensor] = []
    weighted: list[torch.Tensor] = []
    if big:
        p = torch.stack([v.to(torch.int64).sum() for v in big])
        local = torch.stack(
            [
                (v.to(torch.int64) * torch.arange(1, v.numel() + 1, device=v.device, dtype=torch.int64)).sum()
                for v in big
            ]
        )
        plains.append(p.sum())
        weighted.append((local + p * offsets).sum())
    if small is not None and positions is not None:
        x = small.to(torch.int64)
        plains.append(x.sum())
        weighted.append((x * positions).sum())
    return torch.stack([torch.stack(plains).sum(), torch.stack(weighted).sum()])


_COMPILED: list[Callable[..., torch.Tensor]] = []


def _compiled(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A prototype, not taken (a first check that compiles for 11-17 s on the H200): ``params_digest``'s arithmetic,
    ``torch.compile``d (``fullgraph``, static shapes): per tensor of ``_SMALL`` elements or more its plain sum and
    its sum weighted by its own positions (k + 1), in one kernel that reads the int view once and widens in
    registers, then ``plain = sum p_t``, ``weighted = sum (w_t + o_t p_t)`` with o_t the tensor's offset in
    ``main``'s order (position o_t + k + 1); the smaller tensors concatenated (one eager ``torch.cat``, ~0.1 % of
    GPT-2's elements) and weighted by their positions in ``main``'s order, kept in an int64 tensor. All in int64,
    wrapping modulo 2**64 like ``main``'s sums: bitwise-equivalent (asserted). The views, offsets and positions are
    kept per parameter list (a cheap host key: no views made to check it); the first call compiles (``setup``)."""
    if not tensors:
        return torch.zeros(F.WORDS, dtype=torch.int64)
    packed = _packed(tensors)
    assert isinstance(packed, _Packed)
    if not packed.big and not packed.small:
        return torch.zeros(F.WORDS, dtype=torch.int64, device=tensors[0].device)
    if not _COMPILED:
        _COMPILED.append(torch.compile(_digest_sums, fullgraph=True, dynamic=False))
    small = torch.cat(packed.small) if packed.small else None
    return _COMPILED[0](packed.big, packed.offsets, small, packed.positions)


class _Graphed:
    """``fn`` captured in a CUDA graph per parameter list (``_key``) and replayed; the digest is the graph's static
    output (read it before the next call). Warm-up on a side stream, then capture, as torch's CUDA graph docs say.
    The same words as ``fn``."""

    def __init__(self, fn: Digest) -> None:
        self.fn = fn
        self.key: tuple | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        key = F._key(tensors)
        if key != self.key or self.graph is None or self.out is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self.fn(tensors)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.fn(tensors)
            self.key = key
        self.graph.replay()
        return self.out


@dataclass(frozen=True)
class Variant:
    fn: Digest
    kind: str
    """``same`` (main's two int64 words), ``low32`` (main's words modulo 2**32) or ``different``."""
    cuda: bool = False
    """CUDA only (skipped on another device)."""


def _main(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return F.params_digest(tensors)


def _summed(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``params_digest`` as it was at run ``f`` (main ``694cac1``): the plan, each chunk concatenated in its own width
    and reduced twice with ``sum(dtype=torch.int64)`` (each a widening copy), eagerly. same."""
    plan = F._plan(tensors, tensors[0].device)
    rows, cols = _row_col_sums(plan, torch.int64)
    return torch.stack([rows.sum(), (rows * plan.row_weights).sum() + (cols * plan.col_weights).sum()])


def _tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The per-parameter fingerprints folded: the plain word is ``main``'s, the weighted one sums each tensor's
    own position-weighted sum (no offsets). Different: a flipped bit or a swap within a tensor is seen, two
    swapped tensors of one shape are not."""
    return F.param_fingerprints(tensors).sum(0)


VARIANTS: dict[str, Variant] = {
    "before": Variant(_before, "same"),
    "main": Variant(_main, "same"),
    "summed": Variant(_summed, "same"),
    "tensors": Variant(_tensors, "different"),
    "widen": Variant(_widen, "same"),
    "int32wrap": Variant(_int32wrap, "low32"),
    "pairs": Variant(_pairs, "different"),
    "compiled": Variant(_compiled, "same"),
    "graph": Variant(_Graphed(_summed), "same", cuda=True),
    "graph_widen": Variant(_Graphed(_widen), "same", cuda=True),
    "graph_pairs": Variant(_Graphed(_pairs), "different", cuda=True),
    "compiled_graph": Variant(_Graphed(_compiled), "same", cuda=True),
}


def low32(x: torch.Tensor) -> torch.Tensor:
    """A digest's words modulo 2**32, as int64 in [0, 2**32)."""
    return x.to(torch.int64) & 0xFFFFFFFF


def check(name: str, digest: torch.Tensor, reference: torch.Tensor) -> None:
    """Assert that ``digest`` is what variant ``name``'s kind promises against ``main``'s ``reference``."""
    kind = VARIANTS[name].kind
    if kind == "same":
        assert torch.equal(digest, reference), (name, digest, reference)
    elif kind == "low32":
        assert torch.equal(low32(digest), low32(reference)), (name, digest, reference)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="gpt2", choices=sorted(overhead.SIZES))
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--variants", default=None, help=f"comma list (default: all): {','.join(VARIANTS)}")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    names = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {','.join(VARIANTS)}")
    skipped = [n for n in names if VARIANTS[n].cuda and device.type != "cuda"]
    names = [n for n in names if n not in skipped]
    if skipped:
        print(f"skipped (CUDA only): {','.join(skipped)}")
    started = time.perf_counter()
    model = overhead.build_model(overhead.SIZES[args.model], device)
    params = [q.detach() for q in model.parameters()]
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    reserved = torch.cuda.memory_reserved if on_cuda else (lambda: 0)
    reference = F.params_digest(params).clone()  # main's words, and its plan
    t = time.perf_counter()
    for _ in range(20):
        F._plan(params, device)
    plan_ms = (time.perf_counter() - t) / 20 * 1e3
    setup: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}
    for name in names:  # warm-up: plan, compile or capture (timed apart), then the check against main
        fn = VARIANTS[name].fn
        try:
            sync()
            before_reserved = reserved()
            t = time.perf_counter()
            fn(params)
            sync()
            ms, mb = (time.perf_counter() - t) * 1e3, (reserved() - before_reserved) / 2**20
            digest = fn(params).clone()
            check(name, digest, reference)
            if isinstance(fn, _Graphed):  # a replay gives its eager function's words (graph_pairs: not main's)
                assert torch.equal(digest, fn.fn(params)), name
        except Exception as e:  # one run decides: a variant that fails (or differs from main) is reported, not fatal
            failed[name] = f"{type(e).__name__}: {e}"[:500]
            print(f"FAILED {name}: {failed[name]}")
            continue
        setup[name] = {"ms": ms, "reserved_mb": mb}
    names = [n for n in names if n not in failed]
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = VARIANTS[name].fn
            sync()
            t = time.perf_counter()
            fn(params)
            sync()
            times[name].append((time.perf_counter() - t) * 1e3)
    out: dict = {
        "device": str(device),
        "model": args.model,
        "n_params": sum(q.numel() for q in params),
        "tensors": len(params),
        "torch": torch.__version__,
        "plan_lookup_ms": plan_ms,
        "failed": failed,
        "ms": {},
    }
    where = torch.cuda.get_device_name(device) if on_cuda else str(device)
    print(f"{out['n_params']} parameters in {len(params)} tensors on {where}; torch {torch.__version__}")
    print(f"main: _plan lookup (host only) {plan_ms:.3f} ms a call")
    for name, xs in times.items():
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        s = setup[name]
        out["ms"][name] = {
            "p25": q[0],
            "median": statistics.median(xs),
            "p75": q[2],
            "kind": VARIANTS[name].kind,
            "setup_ms": s["ms"],
            "setup_reserved_mb": s["reserved_mb"],
        }
        print(
            f"{name:15s} p25 {q[0]:8.3f}  median {statistics.median(xs):8.3f}  p75 {q[2]:8.3f} ms"
            f"   [{VARIANTS[name].kind:9s}] setup {s['ms']:9.1f} ms  +reserved {s['reserved_mb']:7.1f} MB"
        )
    out["wall_s"] = time.perf_counter() - started
    print(f"done in {out['wall_s']:.1f} s (model, setups and reps)")
    if args.out:
        args.out.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    sys.exit(1 if main()["failed"] else 0)
