#!/usr/bin/env python
"""Issue 16's one table: every variant, per-block paired ratios, in ONE process per run.

Models, variants, batches and the interleaved block timing are ``overhead.py``'s (imported, not
copied; its docstring defines the variants and the method). What this adds:

* **Groups.** A group is one model size; every block of a group times every variant of the group
  once (``--block`` steps each, device synchronised at the edges), in an order rotated per block.
  The variants of a group are built together and freed before the next group.

  CUDA (GPT-2 fp16 autocast, ``GradScaler(init_scale=4096)``):

  ==========  =============  ====================================================================
  group       model          variants
  ==========  =============  ====================================================================
  b8          GPT-2 124M, 8  plain, plain2 (control), guard, clip, guard_clip, guard_exporters
  b16         GPT-2 124M, 16 the same
  foreach     GPT-2 124M, 8  plain, guard (``foreach=True`` AdamW)
  350m        GPT-2 350M, 8  plain, guard (24 layers, d=1024, 16 heads)
  compile     GPT-2 124M, 8  plain, guard, each model ``nn.Module.compile()``-d in place (inductor)
  compile-    GPT-2 124M, 8  the same with ``foreach=True`` AdamW (``compile-foreach``), at batch 16
  foreach,                   (``compile-b16``) and GPT-2 350M (``compile-350m``): issue 26's other
  -b16, -350m                compiled rows (stop 60)
  sentinel    GPT-2 124M, 8  plain, guard, guard with ``sentinel="top"``, and that sentinel batched
                             (``AMPGUARD_SENTINEL_BATCH``, stop 65)
  ==========  =============  ====================================================================

  CPU (bf16 autocast, GradScaler on): ``mlp-8x512`` (plain, plain2, guard, clip, guard_clip,
  guard_exporters fused; plain, guard foreach), ``mlp`` and ``mlp-small`` (plain, guard, fused and
  foreach). All fused unless named.

  ``plain2`` is the plain loop built a second time: ``plain2 / plain`` is the noise floor.
  ``guard_exporters`` runs ampguard's real PrometheusExporter (127.0.0.1, an ephemeral port) and
  JsonlExporter (``every_step=True``, a line per healthy step, to a tmp file).

* **Ratios.** For each (variant, baseline) pair and each block i: r_i = t_variant[i] / t_base[i]
  (the two ran in the same block, seconds apart). Reported: p25 / median / p75 of r_i; and the
  fastest-blocks ratio, mean of the fastest quarter of the variant's blocks over the same for the
  baseline ("fastest quartile"), plus the ratio of the single fastest blocks.

* **Memory (CUDA, b8 models, its own phase).** Per variant, alone on the device, after a throwaway
  warm-up variant (one-time allocations: cuBLAS workspaces and the like):
  ``reset_peak_memory_stats()`` once, *before the model is built* (the user's own reset, outside
  any guarded step), then build + 5 steps with no reset in between; the step peak is
  ``max_memory_allocated()`` then, minus the bytes allocated before the build. While the variant
  is built and stepped, ``torch.cuda.reset_peak_memory_stats`` is wrapped by a counter
  (``resets_by_variant`` must be 0). Then a user peak above the steps' own (a tensor of the
  difference + 1 GiB, allocated and freed) and a 6th step: the peak read after it must still be
  the user's (``user_peak_survives``). Each variant is measured inside one function, so nothing
  of the previous one is alive; ``plain_fused#2`` is plain measured again, last (a check on order).

* **Syncs (CUDA).** ``overhead.sync_phase`` for the b8 fused variants: debug-mode syncs per step,
  whether a step raises under ``set_sync_debug_mode("error")``, ``Event.synchronize`` calls.

* **Profile per variant** (after the group's timing, on the same warmed objects): ``--profile-steps``
  steps under ``torch.profiler``: device kernel time per step (sum of kernel durations; the GPU
  spans of ``record_function`` ranges, e.g. ``Optimizer.step#...``, are kept apart), the GPU
  span per step (first kernel start to last kernel end, over the steps / steps), kernels per step.
  Then, without the profiler, host time per step: the time for ``step()`` calls to return, no sync
  (the host's issue time; capped by the device when the launch queue fills), and wall per step with
  a sync at the end. On CPU the profiler's CPU op self-time replaces kernel time.

``--commit`` records what tree ran (the device copy may have no ``.git``); ``--cprofile`` instead
runs ``cProfile`` over the guarded and the plain step of the first CPU group and prints both,
sorted by tottime. ``--compare A.json B.json`` prints the two runs' ratios side by side.

    python benchmarks/table.py --device cuda --commit $(git rev-parse --short HEAD) --out $OUT/table.json
    python benchmarks/table.py --device cpu --out benchmarks/results/cpu_table.json
    python benchmarks/table.py --device cpu --cprofile
    python benchmarks/table.py --compare run1.json run2.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead as ov  # benchmarks/overhead.py: models, variants, timing

ov.SIZES.setdefault("gpt2-350m", dict(kind="gpt", vocab=50304, seq=1024, layers=24, d=1024, heads=16, batch=8))

B8 = ["plain_fused", "plain2_fused", "guard_fused", "clip_fused", "guard_clip_fused", "guard_exporters_fused"]
# (variant, baseline, issue 16 target); "control" rows have no target
PAIRS_FULL = [
    ("plain2_fused", "plain_fused", None),
    ("guard_fused", "plain_fused", 1.000),
    ("guard_clip_fused", "clip_fused", 0.99),
    ("guard_exporters_fused", "plain_fused", 1.01),
    ("clip_fused", "plain_fused", None),
]

MEMORY_ORDER = ["plain_fused", "guard_fused", "clip_fused", "guard_clip_fused", "guard_exporters_fused",
                "plain_fused#2"]
CUDA_GROUPS: list[dict[str, Any]] = [
    dict(name="b8", size="gpt2", variants=B8, pairs=PAIRS_FULL),
    dict(name="b16", size="gpt2-b16", variants=B8, pairs=PAIRS_FULL),
    dict(name="foreach", size="gpt2", variants=["plain_unfused", "guard_unfused"],
         pairs=[("guard_unfused", "plain_unfused", 1.01)]),
    dict(name="350m", size="gpt2-350m", variants=["plain_fused", "guard_fused"],
         pairs=[("guard_fused", "plain_fused", 1.000)]),
    dict(name="compile", size="gpt2", variants=["plain_fused", "guard_fused"], compile=True, needs_s=150,
         pairs=[("guard_fused", "plain_fused", 1.005)]),
    # issue 26's other compiled rows (stop 60): foreach at most 1.01, 124M at batch 16 and 350M at most 1.000
    dict(name="compile-foreach", size="gpt2", variants=["plain_unfused", "guard_unfused"], compile=True, needs_s=150,
         pairs=[("guard_unfused", "plain_unfused", 1.01)]),
    dict(name="compile-b16", size="gpt2-b16", variants=["plain_fused", "guard_fused"], compile=True, needs_s=150,
         pairs=[("guard_fused", "plain_fused", 1.000)]),
    dict(name="compile-350m", size="gpt2-350m", variants=["plain_fused", "guard_fused"], compile=True, needs_s=200,
         pairs=[("guard_fused", "plain_fused", 1.000)]),
    dict(name="sentinel", size="gpt2", variants=["plain_fused", "guard_fused", "guard_sentinel_fused",
                                                 "guard_sentinelbatch_fused"],
         pairs=[("guard_sentinel_fused", "guard_fused", 1.005), ("guard_sentinelbatch_fused", "guard_fused", 1.005),
                ("guard_sentinelbatch_fused", "guard_sentinel_fused", None), ("guard_fused", "plain_fused", None)]),
]
CPU_GROUPS: list[dict[str, Any]] = [
    dict(name="mlp-8x512", size="mlp-8x512", variants=[*B8, "plain_unfused", "guard_unfused"],
         pairs=[(v, b, 1.05 if v.startswith("guard") else None) for v, b, _ in PAIRS_FULL]
         + [("guard_unfused", "plain_unfused", 1.05)]),
    *(dict(name=s, size=s, variants=["plain_fused", "guard_fused", "plain_unfused", "guard_unfused"],
           pairs=[("guard_fused", "plain_fused", 1.05), ("guard_unfused", "plain_unfused", 1.05)])
      for s in ("mlp", "mlp-small")),
]


# ---------------------------------------------------------------------------------------- building


def build(label: str, ctx: dict[str, Any], compile_model: bool = False) -> ov.Variant:
    """``overhead.build_variant`` for ``label`` (``plain2`` = plain again, renamed)."""
    kind, opt = label.rsplit("_", 1)
    v = ov.build_variant("plain" if kind == "plain2" else kind, opt == "fused", ctx)
    v.name = label
    if compile_model:
        v.info["model"].compile(backend=ctx["compile_backend"])  # in place: the variant's closure calls it
    return v


def make_ctx(size_key: str, device: torch.device, tmpdir: str, compile_backend: str,
             cpu_autocast: str = "bfloat16") -> dict[str, Any]:
    size = ov.SIZES[size_key]
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    # ``--cpu-autocast off``: the forward in float32 on a CPU without bf16 matmul units (AVX2 only), where bf16
    # autocast is emulated and makes mlp-small's step ~36 ms instead of ~5 (stop 56): the guard's step is then
    # under 1 % of it and every ratio reads ~1.00, which measures nothing. GradScaler stays on either way.
    on = device.type == "cuda" or cpu_autocast != "off"
    return {
        "device": device,
        "size": size,
        "batch": ov.make_batch(size, device),
        "autocast": lambda: torch.autocast(device.type, dtype=amp_dtype, enabled=on),
        "init_scale": 2.0**12,  # as overhead.py: below the GPT's fp16 overflow at step 0
        "tmpdir": tmpdir,
        "compile_backend": compile_backend,
    }


def free(variants: list[ov.Variant], device: torch.device) -> None:
    for v in variants:
        try:
            v.close()
        except Exception as exc:  # a benchmark must still write what it measured
            print(f"  close {v.name}: {exc!r}", flush=True)
    variants.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- statistics


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return (xs[0], xs[0], xs[0]) if xs else (float("nan"),) * 3
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def fastest_quartile_mean(xs: list[float]) -> float:
    s = sorted(xs)
    k = max(1, len(s) // 4)
    return statistics.fmean(s[:k])


def pair_stats(v: list[float], b: list[float]) -> dict[str, Any]:
    n = min(len(v), len(b))
    r = [v[i] / b[i] for i in range(n)]
    p25, med, p75 = quartiles(r)
    return {
        "blocks": n,
        "ratio_p25": p25,
        "ratio_median": med,
        "ratio_p75": p75,
        "ratio_of_medians": statistics.median(v) / statistics.median(b),
        "ratio_fastest_quartile": fastest_quartile_mean(v) / fastest_quartile_mean(b),
        "ratio_of_min": min(v) / min(b),
    }


def variant_stats(times: list[float]) -> dict[str, Any]:
    p25, med, p75 = quartiles(times)
    return {"blocks": len(times), "median_ms": 1e3 * med, "p25_ms": 1e3 * p25, "p75_ms": 1e3 * p75,
            "min_ms": 1e3 * min(times), "fastest_quartile_ms": 1e3 * fastest_quartile_mean(times)}


# ---------------------------------------------------------------------------------------- profile


def profile_variant(v: ov.Variant, device: torch.device, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    ov.sync(device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            v.step()
        ov.sync(device)
    cpu_self_us = 0.0
    start, end = float("inf"), 0.0
    by_name: dict[str, list[float]] = {}
    kernel_names: dict[str, list[float]] = {}  # every kernel, none left out (by_name keeps the 60 longest ops)

    def tally(table: dict[str, list[float]], name: str, us: float) -> None:
        e = table.setdefault(name, [0, 0.0])
        e[0] += 1
        e[1] += us

    for ev in prof.events():
        dt = str(getattr(ev, "device_type", ""))
        if on_cuda and "CUDA" in dt:
            us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            if getattr(ev, "is_user_annotation", False):  # a record_function range's GPU span, not a kernel
                tally(by_name, "[annotation] " + ev.name[:100], us)
                continue
            tally(kernel_names, ev.name[:120], us)
            start, end = min(start, ev.time_range.start), max(end, ev.time_range.end)
        elif "CPU" in dt:
            us = ev.self_cpu_time_total
            cpu_self_us += us
        else:
            continue
        tally(by_name, ev.name[:120], us)
    kernels = sum(c for c, _ in kernel_names.values())
    kernel_us = sum(t for _, t in kernel_names.values())
    out: dict[str, Any] = {"profiled_steps": steps, "ops_per_step": {
        n: [c / steps, t / steps] for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:60]}}
    if on_cuda:
        out["kernels_by_name_per_step"] = {n: [c / steps, t / steps] for n, (c, t) in kernel_names.items()}
        out.update(kernel_ms_per_step=kernel_us / steps / 1e3, kernels_per_step=kernels / steps,
                   gpu_span_ms_per_step=(end - start) / steps / 1e3 if kernels else None)
    else:
        out["cpu_op_self_ms_per_step"] = cpu_self_us / steps / 1e3
    # host time without the profiler: issue time (no sync) and wall (sync at the end)
    issue, wall = [], []
    for _ in range(3):
        ov.sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            v.step()
        t1 = time.perf_counter()
        ov.sync(device)
        t2 = time.perf_counter()
        issue.append((t1 - t0) / steps)
        wall.append((t2 - t0) / steps)
    out["host_issue_ms_per_step"] = 1e3 * statistics.median(issue)
    out["wall_ms_per_step"] = 1e3 * statistics.median(wall)
    if on_cuda:
        out["gpu_busy_fraction"] = out["kernel_ms_per_step"] / out["wall_ms_per_step"]
    return out


# ---------------------------------------------------------------------------------------- memory


class ResetCounter:
    """Counts ``torch.cuda.reset_peak_memory_stats`` calls made through either public name."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = torch.cuda.reset_peak_memory_stats

    def __enter__(self) -> ResetCounter:
        orig = self._orig

        def counted(*a: Any, **k: Any) -> Any:
            self.count += 1
            return orig(*a, **k)

        torch.cuda.reset_peak_memory_stats = counted  # type: ignore[assignment]
        torch.cuda.memory.reset_peak_memory_stats = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *a: Any) -> None:
        torch.cuda.reset_peak_memory_stats = self._orig  # type: ignore[assignment]
        torch.cuda.memory.reset_peak_memory_stats = self._orig  # type: ignore[assignment]


def _memory_one(label: str, ctx: dict[str, Any], steps: int) -> dict[str, Any]:
    """One variant's step peak, alone on the device (every object of it dies on return)."""
    device = ctx["device"]
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)  # the user's reset, before the model exists
    before = torch.cuda.memory_allocated(device)
    with ResetCounter() as rc:
        v = build(label.split("#")[0], ctx)
        for _ in range(steps - 1):
            v.step()
        ov.sync(device)
        step_peak = torch.cuda.max_memory_allocated(device)
        # a user peak made between steps, above the steps' own: the last guarded step must leave it
        spike = torch.empty(step_peak - torch.cuda.memory_allocated(device) + (1 << 30), dtype=torch.uint8,
                            device=device)
        user_peak = torch.cuda.max_memory_allocated(device)
        del spike
        v.step()
        ov.sync(device)
    out = {"peak_bytes": step_peak - before, "resets_by_variant": rc.count,
           "user_peak_survives": torch.cuda.max_memory_allocated(device) == user_peak}
    free([v], device)
    return out


def memory_phase(labels: list[str], ctx: dict[str, Any], steps: int = 6) -> dict[str, Any]:
    """``labels`` measured in order; ``plain_fused#2`` is plain again, last (a control on the order)."""
    _memory_one("plain_fused", ctx, 3)  # a throwaway first: one-time allocations
    res = {label: _memory_one(label, ctx, steps) for label in labels}
    base = res["plain_fused"]["peak_bytes"]
    for e in res.values():
        e["delta_vs_plain_bytes"] = e["peak_bytes"] - base
    return res


# ---------------------------------------------------------------------------------------- run


def run_group(spec: dict[str, Any], args: argparse.Namespace, device: torch.device, tmpdir: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    ctx = make_ctx(spec["size"], device, tmpdir, args.compile_backend, args.cpu_autocast)
    variants = [build(label, ctx, spec.get("compile", False)) for label in spec["variants"]]
    t_built = time.perf_counter()
    warmup = args.warmup + (args.compile_warmup if spec.get("compile") else 0)
    ov.time_variants(variants, SimpleNamespace(warmup=warmup, blocks=args.blocks, block=args.block), device)
    t_timed = time.perf_counter()
    times = {v.name: v.times for v in variants}
    compiled_stats = None
    if spec.get("compile"):
        from torch._dynamo.utils import counters

        compiled_stats = {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break", "recompiles")}
    out: dict[str, Any] = {
        "model_size": spec["size"],
        "model": ov.SIZES[spec["size"]],
        "compiled": bool(spec.get("compile")),
        "variants": {name: variant_stats(t) for name, t in times.items()},
        "pairs": {},
        "block_times_ms": {name: [round(1e3 * x, 4) for x in t] for name, t in times.items()},
        "dynamo_counters": compiled_stats,
    }
    for v_name, b_name, target in spec["pairs"]:
        e = pair_stats(times[v_name], times[b_name])
        e.update(variant=v_name, baseline=b_name, target=target)
        out["pairs"][f"{v_name}/{b_name}"] = e
    for v in variants:
        g = v.info.get("guard")
        if g is not None:
            out["variants"][v.name]["skipped_steps"] = g.skipped_steps
            out["variants"][v.name]["final_loss_scale"] = g.get_scale()
        if "exporters" in v.info:
            out["variants"][v.name]["exporters"] = v.info["exporters"]
    if args.profile_steps:
        for v in variants:
            try:
                out["variants"][v.name]["profile"] = profile_variant(v, device, args.profile_steps)
            except Exception:
                out["variants"][v.name]["profile"] = {"error": traceback.format_exc()[-1500:]}
    free(variants, device)
    out["seconds"] = {"build": t_built - t0, "timing": t_timed - t_built, "total": time.perf_counter() - t0}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--groups", default=None, help="comma list of group names (default: all for the device)")
    ap.add_argument("--blocks", type=int, default=None, help="timed blocks per variant (default 40 CUDA, 60 CPU)")
    ap.add_argument("--block", type=int, default=None, help="steps per block (default 5 CUDA, 4 CPU)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed blocks first")
    ap.add_argument("--compile-warmup", type=int, default=1, help="extra untimed blocks for compiled groups")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--profile-steps", type=int, default=None, help="profiled steps per variant (0: none)")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-variants", default=",".join(MEMORY_ORDER),
                    help="comma list of the memory phase's variants, in order (plain_fused among them: the base; "
                         "'#2' measures a label again), e.g. plain_fused,guard_fused,guard_sentinel_fused,"
                         "guard_sentinelbatch_fused,plain_fused#2 (stop 67: the sentinel's peaks)")
    ap.add_argument("--no-syncs", action="store_true")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip the groups left once this is spent")
    ap.add_argument("--commit", default=None, help="the tree's commit (the device copy may have no .git)")
    ap.add_argument("--out", default=None, help="JSON here; the markdown table beside it (.md)")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the guarded vs plain step (CPU) and exit")
    ap.add_argument("--compare", nargs=2, metavar="JSON", help="print two runs' ratios side by side and exit")
    ap.add_argument("--cpu-autocast", choices=("bfloat16", "off"), default="bfloat16",
                    help="CPU forward under bf16 autocast (default) or float32 ('off': a host with no bf16 matmul "
                         "units, where emulated bf16 swamps the step; GradScaler stays on)")
    args = ap.parse_args(argv)
    memory_variants = [label for label in args.memory_variants.split(",") if label]
    odd = [label for label in memory_variants if not label.split("#")[0].endswith(("_fused", "_unfused"))]
    if "plain_fused" not in memory_variants or odd:
        ap.error(f"--memory-variants: labels KIND_fused or KIND_unfused (optionally #N), plain_fused among them "
                 f"(the base); got {args.memory_variants!r}")
    if args.compare:
        runs = []
        for path in args.compare:
            with open(path) as f:
                runs.append(json.load(f))
        print(compare_md(*runs, names=args.compare))
        return 0
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    args.blocks = args.blocks or (40 if on_cuda else 60)
    args.block = args.block or (5 if on_cuda else 4)
    if args.profile_steps is None:
        args.profile_steps = 5 if on_cuda else 8
    groups = CUDA_GROUPS if on_cuda else CPU_GROUPS
    if args.groups:
        wanted = args.groups.split(",")
        groups = [g for g in groups if g["name"] in wanted]
    tmpdir = tempfile.mkdtemp(prefix="ampguard-table-")
    if args.cprofile:
        return cprofile_main(groups[0], args, device, tmpdir)

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    results: dict[str, Any] = {"meta": {
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "commit": args.commit,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if on_cuda else (platform.processor() or platform.machine()),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": load,
        "blocks": args.blocks,
        "block": args.block,
        "warmup_blocks": args.warmup,
        "autocast_dtype": "float16" if on_cuda else ("bfloat16" if args.cpu_autocast != "off" else "off"),
        "grad_scaler": {"enabled": True, "init_scale": 2.0**12},
    }, "groups": {}}
    t_start = time.perf_counter()

    def save() -> None:
        results["meta"]["wall_s"] = time.perf_counter() - t_start
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)
            with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
                f.write(table_md(results))

    print(json.dumps({k: results["meta"][k] for k in ("command", "commit", "device", "torch")}), flush=True)
    if on_cuda and not (args.no_memory and args.no_syncs):
        ctx = make_ctx("gpt2", device, tmpdir, args.compile_backend, args.cpu_autocast)
        for phase, skip, fn in (
            ("memory", args.no_memory, lambda: memory_phase(memory_variants, ctx)),
            ("syncs", args.no_syncs, lambda: ov.sync_phase([("plain", True), ("guard", True), ("guard_clip", True),
                                                             ("guard_exporters", True)], ctx)),
        ):
            if not skip:
                ov.run_phase(results, phase, fn, t_start, save)
    for spec in groups:
        if time.perf_counter() - t_start + spec.get("needs_s", 30) > args.budget_s:
            results["groups"][spec["name"]] = {"skipped": f"budget {args.budget_s:g}s spent"}
            continue
        try:
            results["groups"][spec["name"]] = run_group(spec, args, device, tmpdir)
        except Exception:
            results["groups"][spec["name"]] = {"error": traceback.format_exc()[-3000:]}
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
        print(f"[{time.perf_counter() - t_start:.0f}s] group {spec['name']} done", flush=True)
        save()
    try:
        results["meta"]["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    save()
    print(table_md(results), flush=True)
    return 0


def cprofile_main(spec: dict[str, Any], args: argparse.Namespace, device: torch.device, tmpdir: str) -> int:
    ctx = make_ctx(spec["size"], device, tmpdir, args.compile_backend, args.cpu_autocast)
    steps = args.blocks * args.block
    for label in ("plain_fused", "guard_fused", "plain_unfused", "guard_unfused"):
        v = build(label, ctx)
        for _ in range(10):
            v.step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            v.step()
        prof.disable()
        dt = (time.perf_counter() - t0) / steps
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(f"\n===== {label} ({spec['size']}): {steps} steps, {1e3 * dt:.3f} ms/step under cProfile =====")
        print(s.getvalue())
        free([v], device)
    return 0


# ---------------------------------------------------------------------------------------- markdown


def _f(x: Any, nd: int = 3) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def table_md(results: dict[str, Any]) -> str:
    m = results["meta"]
    lines = [f"commit `{m.get('commit')}`, {m['device']}, torch {m['torch']}, {m['date_utc']}, "
             f"{m['blocks']} blocks x {m['block']} steps per variant, wall {m.get('wall_s', 0):.0f} s",
             f"command: `{m['command']}`", "",
             "| group | variant / baseline | target | per-block ratio p25 / **median** / p75 | fastest quartile | "
             "fastest block | median ms (variant; baseline) | met (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for gname, g in results["groups"].items():
        if "pairs" not in g:
            lines.append(f"| {gname} | {g.get('skipped') or 'FAILED: ' + g.get('error', '')[-200:].splitlines()[-1]}"
                         " | | | | | | |")
            continue
        for e in g["pairs"].values():
            t = e["target"]
            met = "—" if t is None else ("yes" if e["ratio_median"] <= t else f"no (+{e['ratio_median'] - t:.3f})")
            vm, bm = g["variants"][e["variant"]]["median_ms"], g["variants"][e["baseline"]]["median_ms"]
            lines.append(
                f"| {gname} | {e['variant']} / {e['baseline']} | {'control' if t is None else f'≤ {t:.3f}'} | "
                f"{e['ratio_p25']:.3f} / **{e['ratio_median']:.3f}** / {e['ratio_p75']:.3f} | "
                f"{e['ratio_fastest_quartile']:.3f} | {e['ratio_of_min']:.3f} | {vm:.2f}; {bm:.2f} | {met} |")
    lines += ["", "| group | variant | median ms (p25-p75) | kernel ms/step | GPU span ms/step | kernels/step | "
              "host issue ms/step | wall ms/step | GPU busy |", "|---|---|---|---|---|---|---|---|---|"]
    for gname, g in results["groups"].items():
        for name, e in g.get("variants", {}).items():
            p = e.get("profile", {})
            busy = p.get("gpu_busy_fraction")
            lines.append(
                f"| {gname} | {name} | {e['median_ms']:.2f} ({e['p25_ms']:.2f}-{e['p75_ms']:.2f}) | "
                f"{_f(p.get('kernel_ms_per_step', p.get('cpu_op_self_ms_per_step')), 2)} | "
                f"{_f(p.get('gpu_span_ms_per_step'), 2)} | {_f(p.get('kernels_per_step'), 0)} | "
                f"{_f(p.get('host_issue_ms_per_step'), 2)} | {_f(p.get('wall_ms_per_step'), 2)} | "
                f"{'—' if busy is None else f'{100 * busy:.0f} %'} |")
    mem = results.get("memory")
    if isinstance(mem, dict) and "error" not in mem:
        lines += ["", "| memory (GPT-2 124M b8) | step peak MiB | Δ vs plain | resets by variant | "
                  "user peak survives |", "|---|---|---|---|---|"]
        for name, e in mem.items():
            d = e.get("delta_vs_plain_bytes")
            lines.append(f"| {name} | {e['peak_bytes'] / 2**20:.1f} | "
                         f"{'—' if d is None else f'{d / 2**20:+.3f} MiB'} | {e['resets_by_variant']} | "
                         f"{e['user_peak_survives']} |")
    syncs = results.get("syncs")
    if isinstance(syncs, dict) and "error" not in syncs:
        lines += ["", "| syncs (b8) | debug-mode syncs / step | raised under \"error\" | Event.synchronize / step |",
                  "|---|---|---|---|"]
        for name, e in syncs.items():
            lines.append(f"| {name} | {e['sync_warnings_per_step']} | {e['raised_under_error_mode']} | "
                         f"{e['event_synchronize_calls_per_step']} |")
    for k in ("memory", "syncs"):
        if isinstance(results.get(k), dict) and "error" in results[k]:
            lines.append(f"\n{k} phase FAILED: {results[k]['error'][-300:]}")
    return "\n".join(lines) + "\n"


def compare_md(a: dict[str, Any], b: dict[str, Any], names: list[str]) -> str:
    lines = [f"run 1: `{names[0]}` ({a['meta']['date_utc']}); run 2: `{names[1]}` ({b['meta']['date_utc']})", "",
             "| group | variant / baseline | median ratio (1; 2) | p25-p75 (1; 2) | fastest quartile (1; 2) | "
             "Δ median |", "|---|---|---|---|---|---|"]
    for gname, g in a["groups"].items():
        h = b["groups"].get(gname, {})
        for key, e in g.get("pairs", {}).items():
            f = h.get("pairs", {}).get(key)
            if f is None:
                continue
            lines.append(
                f"| {gname} | {key} | {e['ratio_median']:.3f}; {f['ratio_median']:.3f} | "
                f"{e['ratio_p25']:.3f}-{e['ratio_p75']:.3f}; {f['ratio_p25']:.3f}-{f['ratio_p75']:.3f} | "
                f"{e['ratio_fastest_quartile']:.3f}; {f['ratio_fastest_quartile']:.3f} | "
                f"{f['ratio_median'] - e['ratio_median']:+.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
