#!/usr/bin/env python
"""Host time of the primitives a guarded step is built from, on one model's real gradients: what
each costs the host before the device has done anything (the device drained before every call).

``benchmarks/host_time.py`` says where a guarded ``step()``'s microseconds go, stage by stage; this
says what the candidate building blocks of those stages cost on their own, so that a redesign can be
priced before it is written: one kernel launch, reading ``.grad`` off every parameter, grouping,
``torch._foreach_norm`` and stacking its per-tensor outputs, GradScaler's fused check-and-unscale, the
fused optimizer's step, and the per-tensor norms replayed from a captured CUDA graph over gradients at
fixed addresses. Run::

    python benchmarks/host_ops.py --device cuda --model gpt2-350m
    python benchmarks/host_ops.py --device cpu --model gpt2-deep
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_time import build

from ampguard.decision_graph import MeasureGraph
from ampguard.stats import grads_by_device_and_dtype, per_tensor_norms


def timed(fn: Callable[[], Any], sync: Callable[[], None], n: int) -> dict[str, float]:
    xs = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter_ns()
        fn()
        xs.append(time.perf_counter_ns() - t0)
    sync()
    qs = statistics.quantiles(xs, n=4)
    return {"p25": qs[0] / 1e3, "median": qs[1] / 1e3, "p75": qs[2] / 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="gpt2-350m")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, loss_fn = build(args.model, device)
    with torch.autocast(device.type, dtype=torch.float16):
        loss = loss_fn()
    (loss * 1024.0).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    small = torch.zeros((), device=device)
    found = torch.zeros((), device=device)
    inv = torch.full((), 1.0, device=device)
    scale = torch.full((), 1024.0, device=device)
    groups = grads_by_device_and_dtype(params)
    outs = torch._foreach_norm(grads, 2.0)
    base = outs[0]._base
    rows: dict[str, dict[str, float]] = {}

    def add(name: str, fn: Callable[[], Any]) -> None:
        fn()  # warm
        rows[name] = timed(fn, sync, args.n)

    add("one small op (small.add_(1))", lambda: small.add_(1.0))
    add("[p.grad for p in params]", lambda: [p.grad for p in params])
    add("grads_by_device_and_dtype (ampguard)", lambda: grads_by_device_and_dtype(params))
    add("_group_tensors_by_device_and_dtype (torch)",
        lambda: torch.utils._foreach_utils._group_tensors_by_device_and_dtype([grads], with_indices=True))
    add("torch._foreach_norm(grads)", lambda: torch._foreach_norm(grads, 2.0))
    add("torch.stack(foreach_norm outputs)", lambda: torch.stack(outs))
    add("per_tensor_norms (ampguard: norm + stack)", lambda: per_tensor_norms(groups, device))
    add("_amp_foreach_non_finite_check_and_unscale_",
        lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv))
    norms = per_tensor_norms(groups, device)
    add("norms * inv; isfinite.all.logical_not", lambda: torch.isfinite(norms * inv).all().logical_not())

    def fused_step() -> None:
        opt.grad_scale, opt.found_inf = scale, found
        opt.step()
        del opt.grad_scale, opt.found_inf
    add("fused AdamW step (grad_scale, found_inf)", fused_step)
    info: dict[str, Any] = {"tensors": len(grads), "foreach_norm_outputs_share_one_base":
                            base is not None and base.numel() == len(outs)
                            and all(o._base is base for o in outs)}
    if device.type == "cuda":  # the norms replayed from a graph over the same gradient tensors
        static = torch.zeros(len(grads), device=device)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                static.copy_(torch.stack(torch._foreach_norm(grads, 2.0)))
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.copy_(torch.stack(torch._foreach_norm(grads, 2.0)))
            found.copy_(torch.isfinite(static * inv).all().logical_not())
        add("CUDA graph replay: norms + found_inf", graph.replay)
        mg = MeasureGraph(True)
        mg.run("norms", lambda: per_tensor_norms(groups, device), grads)  # seen once: eager
        add("MeasureGraph.run (key of every data_ptr + replay)",
            lambda: mg.run("norms", lambda: per_tensor_norms(groups, device), grads))
        add("the key alone (every gradient's data_ptr)", lambda: tuple(map(torch.Tensor.data_ptr, grads)))
        info["measure_graph_replays"] = mg.replays
        info["graph_norms_equal"] = bool(torch.equal(static, torch.stack(torch._foreach_norm(grads, 2.0))))
    width = max(len(k) for k in rows)
    print(f"{args.model} on {device}: {info}")
    for name, q in rows.items():
        print(f"  {name:<{width}}  {q['median']:9.1f} us  (p25 {q['p25']:.1f}, p75 {q['p75']:.1f})")
    if args.json is not None:
        args.json.write_text(json.dumps({"model": args.model, "device": str(device), "info": info, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
