#!/usr/bin/env python
"""Per-step cost of ampguard against what people do today, all variants interleaved in one process.

Variants (each with its own copy of the model, same initial weights, same batch):

  plain            autocast forward, ``scaler.scale(loss).backward()``, ``scaler.step``, ``scaler.update``
  clip             + ``scaler.unscale_`` + ``clip_grad_norm_(max_norm=1.0)``
  itemcheck        + ``scaler.unscale_`` + per parameter ``isfinite(g).all().item()`` and ``g.norm().item()``
  anomaly          forward/backward under ``torch.autograd.detect_anomaly()`` (``--anomaly``; fused only)
  guard            ``ampguard.wrap(opt, scaler=scaler, precision="fp16")``, default config
  guard_clip       + ``GuardConfig(clip_grad_norm=1.0)``
  guard_sentinel   + ``GuardConfig(sentinel="top")``: one on-device finiteness flag per top-level block output
                   (issue 14's opt-in sentinel); its ratio is against ``guard``, the cost the sentinel adds
  guard_sentinelbatch  the same with ``AMPGUARD_SENTINEL_BATCH=1`` (stop 65): the outputs read together when the
                   model returns, one ``_foreach_norm`` per dtype (on CUDA); its ratio is against ``guard`` too
  guard_exporters  + ampguard's PrometheusExporter (serving on 127.0.0.1, any free port) and JsonlExporter
                   when those modules import; each missing one is recorded as unavailable, and a stand-in
                   exporter (the benchmark's own: one JSON line + 4 prometheus_client metrics per step)
                   takes its place so the variant still runs (``exporters`` in the JSON says which)

each with fused AdamW (``fused=True``) and unfused (foreach) AdamW. Every variant uses the same
``torch.autocast`` context and an enabled GradScaler (loss scaling on): fp16 on CUDA; on CPU the
matmuls run in bf16 (CPU fp16 matmuls are slow emulation, and nobody trains so) while the GradScaler
still scales, unscales and checks exactly as in fp16 -- the bookkeeping the guard adds is the same.

Timing: ``--steps`` timed steps per variant in blocks of ``--block`` steps; each block visits every
variant once, in an order rotated per block; the device is synchronised at block edges and a block's
time / ``--block`` is one sample. Median, min and max of the samples. ``--warmup`` blocks first, untimed.

On CUDA also: peak memory per variant (a fresh model per variant, alone on the device, peak of
``max_memory_allocated`` over two steps after warm-up), host-device syncs per step
(``torch.cuda.set_sync_debug_mode`` "warn" counts, "error" raised or not; plus the
``torch.cuda.Event.synchronize`` calls, which the debug mode does not see), the cost of one read of
every gradient (``torch._foreach_norm``), and a ``torch.profiler`` comparison of the guarded and
plain step (kernel counts and device time per step). On CPU the profile compares CPU op time.

    python benchmarks/overhead.py --quick --out benchmarks/results/cpu_quick.json
    python benchmarks/overhead.py --device cuda --out benchmarks/results/h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import inspect
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

# the root after PYTHONPATH: a library named there runs (frameworks_cost.py FW_BASE; stop 54)
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ampguard

CLIP = 1.0

# ---------------------------------------------------------------------------------------- models


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 style: learned positions, pre-LN blocks, tied embedding / output head."""

    def __init__(self, vocab: int, seq: int, layers: int, d: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class MLP(nn.Module):
    def __init__(self, d_in: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        dims = [d_in] + [width] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = F.gelu(lin(x))
        return self.head(x)


SIZES: dict[str, dict[str, Any]] = {
    # the model: 124M parameters (tied head)
    "gpt2": dict(kind="gpt", vocab=50304, seq=1024, layers=12, d=768, heads=12, batch=8),
    # the same model with twice the batch: twice the device work per step, the same host work
    "gpt2-b16": dict(kind="gpt", vocab=50304, seq=1024, layers=12, d=768, heads=12, batch=16),
    "gpt-tiny": dict(kind="gpt", vocab=4096, seq=128, layers=2, d=128, heads=4, batch=4),
    "mlp": dict(kind="mlp", d_in=512, width=1024, depth=4, classes=100, batch=128),
    "mlp-small": dict(kind="mlp", d_in=256, width=512, depth=3, classes=100, batch=128),
    # the CPU model: 8 layers of 512x512
    "mlp-8x512": dict(kind="mlp", d_in=512, width=512, depth=8, classes=100, batch=128),
}


def build_model(size: dict[str, Any], device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    if size["kind"] == "gpt":
        m = GPT(size["vocab"], size["seq"], size["layers"], size["d"], size["heads"])
    else:
        m = MLP(size["d_in"], size["width"], size["depth"], size["classes"])
    return m.to(device)


def make_batch(size: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if size["kind"] == "gpt":
        x = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)
        y = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)
    else:
        x = torch.randn(size["batch"], size["d_in"], generator=g)
        y = torch.randint(0, size["classes"], (size["batch"],), generator=g)
    return x.to(device), y.to(device)


def compute_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---------------------------------------------------------------------------------------- exporters


class StandInExporter:
    """Not ampguard's: what a minimal JSONL + Prometheus exporter costs per step (used only when
    ampguard's own exporters are not importable)."""

    def __init__(self, path: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.f = open(path, "a", buffering=1)  # noqa: SIM115
        self.loss = Gauge("standin_loss", "loss", registry=self.registry)
        self.norm = Gauge("standin_grad_norm", "grad norm", registry=self.registry)
        self.scale = Gauge("standin_loss_scale", "scale", registry=self.registry)
        self.steps = Counter("standin_steps", "steps", ["skipped"], registry=self.registry)

    def open(self, info: Any) -> None:
        self.f.write(json.dumps({"run_id": info.run_id}) + "\n")

    def export(self, report: Any, anomalies: Any) -> None:
        self.f.write(json.dumps(dataclasses.asdict(report)) + "\n")
        self.loss.set(report.loss)
        self.norm.set(report.grad_norm)
        self.scale.set(report.loss_scale)
        self.steps.labels(str(report.skipped).lower()).inc()

    def close(self) -> None:
        self.f.close()


def _construct(cls: type, tmpdir: str) -> Any:
    """Build an exporter from what its signature asks for (the modules are being written)."""
    kwargs: dict[str, Any] = {}
    for name, p in inspect.signature(cls).parameters.items():
        if name == "port":
            kwargs[name] = 0
        elif name in ("addr", "host", "address"):
            kwargs[name] = "127.0.0.1"
        elif name == "registry":
            from prometheus_client import CollectorRegistry

            kwargs[name] = CollectorRegistry()
        elif name in ("path", "file", "filename", "filepath"):
            kwargs[name] = os.path.join(tmpdir, f"events-{os.getpid()}-{time.monotonic_ns()}.jsonl")
        elif name == "every_step":
            kwargs[name] = True  # a line per healthy step: the heavier setting
        elif name in ("dir", "directory", "log_dir", "logdir", "root"):
            kwargs[name] = tempfile.mkdtemp(dir=tmpdir)
        elif p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{cls.__name__}: don't know how to fill required parameter {name!r}")
    return cls(**kwargs)


def make_exporters(tmpdir: str) -> tuple[list[Any], dict[str, str]]:
    out: list[Any] = []
    status: dict[str, str] = {}
    for mod, cls_name in (("prometheus", "PrometheusExporter"), ("jsonl", "JsonlExporter")):
        try:
            module = __import__(f"ampguard.exporters.{mod}", fromlist=[cls_name])
            exp = _construct(getattr(module, cls_name), tmpdir)
            out.append(exp)
            status[cls_name] = "ampguard " + repr(exp)[:200]
        except Exception as exc:  # missing or half-written module: record, stand in
            status[cls_name] = f"unavailable ({type(exc).__name__}: {exc})"
    if len(out) < 2:
        out.append(StandInExporter(os.path.join(tmpdir, f"standin-{time.monotonic_ns()}.jsonl")))
        status["stand_in"] = "StandInExporter (benchmark's own) replaces the unavailable one(s)"
    return out, status


# ---------------------------------------------------------------------------------------- variants


@dataclasses.dataclass
class Variant:
    name: str
    step: Callable[[], None]
    close: Callable[[], None] = lambda: None
    times: list[float] = dataclasses.field(default_factory=list)
    failures: int = 0
    error: str | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def build_variant(kind: str, fused: bool, ctx: dict[str, Any]) -> Variant:
    device: torch.device = ctx["device"]
    model = build_model(ctx["size"], device)
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **({"fused": True} if fused else {"foreach": True}))
    scaler = torch.amp.GradScaler(device.type, init_scale=ctx["init_scale"])
    batch = ctx["batch"]
    autocast = ctx["autocast"]
    name = f"{kind}_{'fused' if fused else 'unfused'}"
    v = Variant(name, step=lambda: None)

    if kind in ("plain", "clip", "itemcheck", "anomaly"):
        checks: list[float] = []

        def step() -> None:
            cm = torch.autograd.detect_anomaly() if kind == "anomaly" else contextlib.nullcontext()
            with cm:
                with autocast():
                    loss = compute_loss(model, batch)
                scaler.scale(loss).backward()
            if kind == "clip":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, CLIP)
            elif kind == "itemcheck":
                scaler.unscale_(opt)
                checks.clear()
                for p in params:
                    if p.grad is not None:
                        checks.append(float(torch.isfinite(p.grad).all().item()))
                        checks.append(p.grad.norm().item())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        v.step = step
        v.info["model"] = model
        return v

    cfg = ampguard.GuardConfig(clip_grad_norm=CLIP) if kind == "guard_clip" else ampguard.GuardConfig()
    if kind in ("guard_sentinel", "guard_sentinelbatch"):
        cfg = ampguard.GuardConfig(sentinel="top")
    if kind == "guard_numerics":  # issue 17: the sampled zero fraction and headroom (benchmarks/numerics.py)
        cfg = ampguard.GuardConfig(numerics_every=ctx.get("numerics_every", 10))
    exporters: list[Any] = []
    if kind == "guard_exporters":
        exporters, v.info["exporters"] = make_exporters(ctx["tmpdir"])
    reads = ({"AMPGUARD_SENTINEL_BATCH": "1" if kind == "guard_sentinelbatch" else "0"}
             if kind in ("guard_sentinel", "guard_sentinelbatch") else {})
    with mock.patch.dict(os.environ, reads):  # read when the sentinel is made: the two sentinel arms differ in it
        g = ampguard.wrap(opt, model=model, scaler=scaler, precision="fp16", config=cfg, exporters=exporters)
    if kind == "guard_lazy":
        _make_lazy(g)
    if kind == "guard_armed":
        # Forensics hooks armed on every step (as after an anomaly, for forensics_window steps):
        # the cost a run pays only while it is being investigated; healthy runs never arm them.
        from ampguard.forensics.localizer import Localizer

        g._forensics.localizer = Localizer(model)

    v.step = guarded_step(g, model, batch, autocast)
    v.close = g.close
    v.info["model"] = model
    v.info["guard"] = g
    return v


def guarded_step(g: Any, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                 autocast: Callable[[], Any]) -> Callable[[], None]:
    """One guarded training step of ``model`` on ``batch`` through the guard ``g`` (what every guard variant times)."""

    def gstep() -> None:
        with autocast():
            loss = compute_loss(model, batch)
        g.backward(loss)
        g.step()
        g.zero_grad(set_to_none=True)

    return gstep


def _make_lazy(g: Any) -> None:
    """Experiment, benchmark-only (ampguard itself is unchanged): report pipeline that never
    blocks. The guard's report decoding waits (``Event.synchronize``) for the previous step's
    report at the start of each ``step()``, which caps how far the host may run ahead of the
    device at one step. Here only the reports whose copy has already finished
    (``Event.query()``) are turned into StepReports; the rest wait for a later step."""
    rep = g._reporter
    real = rep.decode

    def lazy() -> None:
        ready: deque[Any] = deque()
        while rep._pending and (rep._pending[0].event is None or rep._pending[0].event.query()):
            ready.append(rep._pending.popleft())
        if not ready:
            return
        rest, rep._pending = rep._pending, ready
        try:
            real()  # consumes exactly the ready ones, in step order
        finally:
            rep._pending = rest

    rep.decode = lazy


def variant_kinds(args: argparse.Namespace) -> list[tuple[str, bool]]:
    if args.variants:
        out = []
        for name in args.variants.split(","):
            kind, opt = name.strip().rsplit("_", 1)
            out.append((kind, opt == "fused"))
        return out
    kinds = []
    for fused in (True, False):
        for k in ("plain", "clip", "itemcheck", "guard", "guard_clip", "guard_exporters", "guard_sentinel"):
            kinds.append((k, fused))
    if args.anomaly:
        kinds.append(("anomaly", True))
    return kinds


# ---------------------------------------------------------------------------------------- phases


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def safe_step(v: Variant) -> None:
    try:
        v.step()
    except RuntimeError as exc:  # detect_anomaly raises on a NaN in backward (fp16 overflow)
        if not v.name.startswith("anomaly"):
            raise
        v.failures += 1
        v.error = str(exc).splitlines()[0][:300]


def time_variants(variants: list[Variant], args: argparse.Namespace, device: torch.device) -> None:
    for blk in range(args.warmup + args.blocks):
        k = blk % len(variants)
        order = variants[k:] + variants[:k]
        for v in order:
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.block):
                safe_step(v)
            sync(device)
            dt = (time.perf_counter() - t0) / args.block
            if blk >= args.warmup:
                v.times.append(dt)
        if blk == 0:
            print(f"  warm-up block done ({len(variants)} variants)", flush=True)


def summarise(variants: list[Variant]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in variants:
        t = sorted(v.times)
        entry: dict[str, Any] = {
            "median_ms": 1e3 * statistics.median(t),
            "min_ms": 1e3 * t[0],
            "max_ms": 1e3 * t[-1],
            "p25_ms": 1e3 * t[len(t) // 4],
            "p75_ms": 1e3 * t[(3 * len(t)) // 4],
            "samples": len(t),
        }
        if v.failures:
            entry["failed_steps"] = v.failures
            entry["last_error"] = v.error
        if "exporters" in v.info:
            entry["exporters"] = v.info["exporters"]
        out[v.name] = entry
    # ratios against the matching baseline (same optimizer), each guard variant against the loop it replaces
    pairs = {
        "clip": "plain",
        "itemcheck": "plain",
        "anomaly": "plain",
        "guard": "plain",
        "guard_clip": "clip",
        "guard_exporters": "plain",
        "guard_lazy": "plain",
        "guard_armed": "plain",
        "guard_sentinel": "guard",
        "guard_sentinelbatch": "guard",
        "guard_numerics": "guard",
    }
    for name, e in out.items():
        kind, opt = name.rsplit("_", 1)
        base = f"{pairs.get(kind, kind)}_{opt}"
        if base in out and base != name:
            e["baseline"] = base
            e["ratio"] = e["median_ms"] / out[base]["median_ms"]
            e["ratio_of_min"] = e["min_ms"] / out[base]["min_ms"]
        plain = f"plain_{opt}"
        if plain in out:
            e["ratio_vs_plain"] = e["median_ms"] / out[plain]["median_ms"]
    return out


def memory_phase(kinds: list[tuple[str, bool]], ctx: dict[str, Any]) -> dict[str, Any]:
    device = ctx["device"]
    res: dict[str, Any] = {}
    for kind, fused in kinds:
        if kind == "anomaly":
            continue
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        v = build_variant(kind, fused, ctx)
        for _ in range(3):
            v.step()
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        for _ in range(2):
            v.step()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device)
        res[v.name] = {
            "peak_bytes": peak - before,
            "resident_between_steps_bytes": start - before,
            "step_transient_bytes": peak - start,
        }
        v.close()
        del v
    gc.collect()
    torch.cuda.empty_cache()
    for name, e in res.items():
        kind, opt = name.rsplit("_", 1)
        base = "clip" if kind == "guard_clip" else "plain"
        if f"{base}_{opt}" in res:
            e["peak_ratio"] = e["peak_bytes"] / res[f"{base}_{opt}"]["peak_bytes"]
            e["baseline"] = f"{base}_{opt}"
    return res


class EventSyncCounter:
    """Counts ``torch.cuda.Event.synchronize`` calls (the sync debug mode does not report them);
    also used by ``frameworks_cost.py``."""

    def __init__(self) -> None:
        self.count = 0
        self._orig = torch.cuda.Event.synchronize

    def __enter__(self) -> EventSyncCounter:
        orig = self._orig
        counter = self

        def counted(ev: Any) -> Any:
            counter.count += 1
            return orig(ev)

        torch.cuda.Event.synchronize = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *a: Any) -> None:
        torch.cuda.Event.synchronize = self._orig  # type: ignore[method-assign]


def sync_phase(kinds: list[tuple[str, bool]], ctx: dict[str, Any]) -> dict[str, Any]:
    device = ctx["device"]
    res: dict[str, Any] = {}
    for kind, fused in kinds:
        if kind in ("anomaly", "itemcheck"):
            continue
        v = build_variant(kind, fused, ctx)
        for _ in range(3):
            v.step()
        sync(device)
        entry: dict[str, Any] = {}
        # "warn": count the synchronising calls of one step
        with warnings.catch_warnings(record=True) as caught, EventSyncCounter() as evc:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                v.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        msgs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        entry["sync_warnings_per_step"] = len(msgs)
        entry["sync_warning_samples"] = sorted(set(m.splitlines()[0][:160] for m in msgs))[:5]
        entry["event_synchronize_calls_per_step"] = evc.count
        sync(device)
        # "error": does one step raise?
        torch.cuda.set_sync_debug_mode("error")
        try:
            v.step()
            entry["raised_under_error_mode"] = False
        except RuntimeError as exc:
            entry["raised_under_error_mode"] = True
            entry["error"] = str(exc).splitlines()[0][:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        res[v.name] = entry
        try:
            v.close()
        except Exception as exc:
            entry["close_error"] = repr(exc)[:300]
        del v
        gc.collect()
    return res


def grad_read_phase(ctx: dict[str, Any]) -> dict[str, Any]:
    """Cost of reading every gradient once (``torch._foreach_norm`` per dtype group)."""
    device = ctx["device"]
    v = build_variant("plain", True, ctx)
    model = v.info["model"]
    with ctx["autocast"]():
        loss = compute_loss(model, ctx["batch"])
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    for _ in range(5):
        torch._foreach_norm(grads, 2.0)
    reps = 50
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch._foreach_norm(grads, 2.0)
    sync(device)
    ms = 1e3 * (time.perf_counter() - t0) / reps
    n = len(grads)
    del v, model, grads
    gc.collect()
    return {"foreach_norm_ms": ms, "grad_bytes": nbytes, "tensors": n}


def profile_phase(pairs: list[tuple[str, str]], ctx: dict[str, Any], steps: int = 4) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    device = ctx["device"]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    res: dict[str, Any] = {}
    for kind in sorted({k for pair in pairs for k in pair}):
        k, opt = kind.rsplit("_", 1)
        v = build_variant(k, opt == "fused", ctx)
        for _ in range(3):
            v.step()
        sync(device)
        with profile(activities=acts) as prof:
            for _ in range(steps):
                v.step()
            sync(device)
        per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        ops: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for ev in prof.events():
            dt = getattr(ev, "device_type", None)
            if device.type == "cuda" and dt is not None and "CUDA" in str(dt):
                per[ev.name][0] += 1
                per[ev.name][1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            elif "CPU" in str(dt):
                ops[ev.name][0] += 1
                ops[ev.name][1] += ev.self_cpu_time_total
        res[v.name] = {
            "kernels": {n: (c / steps, t / steps) for n, (c, t) in per.items()},
            "cpu_ops": {n: (c / steps, t / steps) for n, (c, t) in ops.items()},
        }
        v.close()
        del v
        gc.collect()
    out: dict[str, Any] = {}
    for base, guard in pairs:
        a, b = res[base], res[guard]
        entry: dict[str, Any] = {"baseline": base, "variant": guard}
        for key in ("kernels", "cpu_ops"):
            ka, kb = a[key], b[key]
            entry[f"{key}_per_step"] = {base: sum(c for c, _ in ka.values()), guard: sum(c for c, _ in kb.values())}
            entry[f"{key}_time_us_per_step"] = {
                base: sum(t for _, t in ka.values()),
                guard: sum(t for _, t in kb.values()),
            }
            names = set(ka) | set(kb)
            diff = []
            for n in names:
                ca, ta = ka.get(n, (0, 0.0))
                cb, tb = kb.get(n, (0, 0.0))
                if (ca, round(ta)) != (cb, round(tb)):
                    diff.append(
                        {
                            "name": n[:140],
                            "count_delta": cb - ca,
                            "time_us_delta": tb - ta,
                            "count": [ca, cb],
                            "time_us": [ta, tb],
                        }
                    )
            diff.sort(key=lambda d: -abs(d["time_us_delta"]))
            extra = [d for d in diff if d["count_delta"] > 0]
            extra.sort(key=lambda d: -d["time_us_delta"])
            entry[f"{key}_top_time_deltas"] = diff[:25]
            entry[f"{key}_added_by_variant"] = extra[:40]
        out[f"{guard}_vs_{base}"] = entry
    return out


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--model-size",
        choices=sorted(SIZES),
        default=None,
        help="gpt2 (default on CUDA: the issue's 124M GPT), mlp (default on CPU), mlp-small, mlp-8x512, gpt-tiny",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="timed steps per variant (default: 150 CUDA, 90 CPU; --quick: 30, 24)"
    )
    ap.add_argument("--block", type=int, default=None, help="steps per timing block (default 5 CUDA, 3 CPU)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed blocks first")
    ap.add_argument("--anomaly", action="store_true", help="also time torch.autograd.detect_anomaly() (slow)")
    ap.add_argument(
        "--variants",
        default=None,
        help="comma list of variants to run, e.g. plain_fused,guard_fused,guard_lazy_fused (default: all "
        "but guard_lazy; guard_lazy is an experiment: a report pipeline that never blocks)",
    )
    ap.add_argument("--quick", action="store_true", help="small model, few steps (under a minute on 2 CPU cores)")
    ap.add_argument("--no-extras", action="store_true", help="skip memory/sync/profile phases")
    ap.add_argument("--out", default=None, help="write the JSON results here")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if args.model_size is None:
        args.model_size = ("gpt-tiny" if on_cuda else "mlp-small") if args.quick else ("gpt2" if on_cuda else "mlp")
    if args.block is None:
        args.block = 5 if on_cuda else 3
    if args.steps is None:
        args.steps = (30 if args.quick else 150) if on_cuda else (24 if args.quick else 90)
    args.blocks = max(1, args.steps // args.block)
    size = SIZES[args.model_size]
    amp_dtype = torch.float16 if on_cuda else torch.bfloat16
    tmpdir = tempfile.mkdtemp(prefix="ampguard-bench-")
    ctx: dict[str, Any] = {
        "device": device,
        "size": size,
        "batch": make_batch(size, device),
        "autocast": lambda: torch.autocast(device.type, dtype=amp_dtype),
        # below fp16's overflow at step 0 for the GPT, so timed steps are not skip steps
        "init_scale": 2.0**12,
        "tmpdir": tmpdir,
    }
    probe = build_model(size, device)
    ctx["param_count_list"] = [p.numel() for p in probe.parameters()]
    n_params = sum(ctx["param_count_list"])
    del probe

    meta = {
        "command": "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ampguard": ampguard.__version__,
        "device": torch.cuda.get_device_name(device) if on_cuda else (platform.processor() or platform.machine()),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model_size": args.model_size,
        "model": size,
        "params": n_params,
        "param_tensors": len(ctx["param_count_list"]),
        "autocast_dtype": str(amp_dtype),
        "grad_scaler": {"enabled": True, "init_scale": ctx["init_scale"]},
        "timed_steps_per_variant": args.blocks * args.block,
        "block": args.block,
        "warmup_blocks": args.warmup,
        "clip_max_norm": CLIP,
    }
    print(json.dumps({k: meta[k] for k in ("command", "device", "torch", "model_size", "params")}), flush=True)

    results: dict[str, Any] = {"meta": meta}
    kinds = variant_kinds(args)
    t_start = time.perf_counter()

    def save() -> None:
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1, default=str)

    if on_cuda and not args.no_extras:
        for phase, fn in (("memory", lambda: memory_phase(kinds, ctx)), ("syncs", lambda: sync_phase(kinds, ctx))):
            run_phase(results, phase, fn, t_start, save)

    variants = [build_variant(k, f, ctx) for k, f in kinds]
    time_variants(variants, args, device)
    results["timing"] = summarise(variants)
    for v in variants:
        v.close()
    for v in variants:
        g = v.info.get("guard")
        if g is not None:
            results["timing"][v.name]["skipped_steps"] = g.skipped_steps
            results["timing"][v.name]["final_loss_scale"] = g.get_scale()
    print(f"[{time.perf_counter() - t_start:.0f}s] timing done", flush=True)
    del variants
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    save()

    if not args.no_extras:
        for phase, fn in (
            ("grad_read", lambda: grad_read_phase(ctx)),
            (
                "profile",
                lambda: profile_phase(
                    [
                        ("plain_fused", "guard_fused"),
                        ("clip_fused", "guard_clip_fused"),
                        ("plain_unfused", "guard_unfused"),
                    ],
                    ctx,
                ),
            ),
        ):
            run_phase(results, phase, fn, t_start, save)

    results["meta"]["wall_s"] = time.perf_counter() - t_start
    save()
    print_table(results)
    return 0


def run_phase(results: dict[str, Any], name: str, fn: Callable[[], Any], t_start: float,
              save: Callable[[], None]) -> None:
    """Run one optional phase: its result, or its traceback, goes to ``results[name]``; then save
    (a failed phase never loses the others). Also used by ``table.py``."""
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()[-2000:]}
    print(f"[{time.perf_counter() - t_start:.0f}s] {name} done", flush=True)
    save()


def print_table(results: dict[str, Any]) -> None:
    t = results["timing"]
    print(f"\n{'variant':28s} {'median ms':>10s} {'min':>8s} {'max':>8s} {'ratio':>7s}  baseline")
    for name, e in t.items():
        r = f"{e['ratio']:.4f}" if "ratio" in e else "1"
        print(
            f"{name:28s} {e['median_ms']:10.3f} {e['min_ms']:8.3f} {e['max_ms']:8.3f} {r:>7s}  "
            f"{e.get('baseline', '')}" + (f"  FAILED x{e['failed_steps']}" if e.get("failed_steps") else "")
        )
    if isinstance(results.get("memory"), dict) and "error" not in results["memory"]:
        print("\npeak memory (MiB, ratio vs baseline):")
        for name, e in results["memory"].items():
            print(f"  {name:28s} {e['peak_bytes'] / 2**20:10.1f}  {e.get('peak_ratio', 1):.4f}")
    if isinstance(results.get("syncs"), dict) and "error" not in results["syncs"]:
        print("\nsyncs per step (debug-mode warnings / Event.synchronize / raised under 'error'):")
        for name, e in results["syncs"].items():
            print(
                f"  {name:28s} {e['sync_warnings_per_step']:3d} {e['event_synchronize_calls_per_step']:3d} "
                f"{e['raised_under_error_mode']}"
            )
    if "grad_read" in results:
        print("\ngrad read:", results["grad_read"])
    prof = results.get("profile", {})
    for key, e in prof.items():
        if not isinstance(e, dict) or "baseline" not in e:
            continue
        kind = "kernels" if any(e["kernels_per_step"].values()) else "cpu_ops"
        print(
            f"\nprofile {key}: {kind}/step {e[f'{kind}_per_step']}, time us/step "
            f"{ {k: round(v, 1) for k, v in e[f'{kind}_time_us_per_step'].items()} }"
        )
        for d in e[f"{kind}_added_by_variant"][:8]:
            print(f"   +{d['count_delta']:6.1f} x  {d['time_us_delta']:9.1f} us  {d['name'][:90]}")
    for k in ("memory", "syncs", "grad_read", "profile"):
        if isinstance(results.get(k), dict) and "error" in results[k]:
            print(f"\n{k} phase FAILED:\n{results[k]['error']}")


if __name__ == "__main__":
    sys.exit(main())
