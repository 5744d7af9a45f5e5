#!/usr/bin/env python
"""Host cost of one healthy step's export, on the training thread (no model, no device).

What the guard calls once per step is ``MultiExporter.export(report, anomalies)``; this times that
call (and each exporter alone) for a healthy :class:`~ampguard.records.StepReport` of a 148-tensor
model (GPT-2's parameter count, ``param_norms`` off as on most steps), best of ``--repeat`` runs of
``--n`` calls, in microseconds per call. Arms:

  null             ``MultiExporter([])``: the dispatch alone
  prometheus       ``PrometheusExporter(port=0, addr="127.0.0.1")`` (serving)
  jsonl            ``JsonlExporter(tmp file)``: its default, a line per step (``fsync_every=100``)
  jsonl_anomalies  ``JsonlExporter(tmp file, every_step=False)``: anomalies and skipped steps only
                   (the default before every step was logged; a healthy step writes nothing)
  both             Prometheus + JSONL, as ``overhead.py``'s ``guard_exporters`` variant
  otel             ``OtelExporter`` into an SDK ``MeterProvider`` with an ``InMemoryMetricReader``
                   (never collected during the timing: the instrument calls alone)
  wandb            ``WandbExporter`` into an offline run (``WANDB_MODE=offline``, a tmp dir)
  mlflow           ``MlflowExporter`` into a local file store (``file:`` tmp dir)

``--arms a,b`` runs some of them (the W&B and MLflow arms start a run per repeat: seconds each).

``--gap-us G`` sleeps G us between exports (what the rest of a step does: the GIL is free while
the host waits for the device or runs most ops) and times each export() alone: the cost on the step
when a writer thread has time to run between steps. Without it the exports run back to back and
a writer thread competes with them for the GIL.

``drain_us`` is the time the exporter then needs to have every record on the OS or handed to its
backend (``flush()`` where the exporter has one: JSONL, W&B, MLflow; else 0): the work moved off
the step, not removed.

    python benchmarks/exporter_cost.py                  # this tree
    PYTHONPATH=/tmp/base python benchmarks/exporter_cost.py   # another tree's ampguard
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ampguard
from ampguard.exporters import JsonlExporter, MultiExporter, PrometheusExporter
from ampguard.records import RunInfo, StepReport


def _report(step: int) -> StepReport:
    return StepReport(step=step, skipped=False, reason=None, loss=3.25 + step * 1e-6, loss_scale=4096.0,
                      next_loss_scale=4096.0, grad_norm=0.75, nonfinite_grads=0, nonfinite_loss=False,
                      nonfinite_ranks=(), clip_coef=1.0, grad_spike=False, loss_spike=False, world_size=1, rank=0,
                      param_norms=None, wall_time=time.time())


def _info() -> RunInfo:
    return RunInfo(run_id="bench", rank=0, local_rank=0, world_size=1, precision="fp16", backend="local",
                   device="cuda:0", param_names=tuple(f"p{i}" for i in range(148)))


def time_arm(make: Any, n: int, repeat: int, gap_s: float = 0.0) -> dict[str, float]:
    best, drain = float("inf"), float("inf")
    reports = [_report(s) for s in range(n)]
    for _ in range(repeat):
        multi = MultiExporter(make())
        multi.open(_info())
        on_step = 0.0
        for r in reports:
            t = time.perf_counter()
            multi.export(r, ())
            on_step += time.perf_counter() - t
            if gap_s:
                time.sleep(gap_s)  # the rest of a step, which leaves the GIL free (device waits, ops)
        t1 = time.perf_counter()
        t0 = t1 - on_step
        for e in multi.exporters:
            flush = getattr(e, "flush", None)
            if callable(flush):
                flush()
        t2 = time.perf_counter()
        multi.close()
        best, drain = min(best, (t1 - t0) / n), min(drain, (t2 - t1) / n)
    return {"us_per_export": 1e6 * best, "drain_us_per_export": 1e6 * drain}


def _otel() -> list[Any]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    return [ampguard.OtelExporter(MeterProvider(metric_readers=[InMemoryMetricReader()]))]


def _wandb(tmp: str) -> list[Any]:
    import wandb

    settings = wandb.Settings(mode="offline", console="off", x_disable_stats=True, disable_git=True, save_code=False,
                              silent=True)
    return [ampguard.WandbExporter(project="ampguard-bench", dir=tmp, settings=settings, timeout_s=600)]


def _mlflow(tmp: str) -> list[Any]:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    return [ampguard.MlflowExporter("file:" + os.path.join(tmp, "mlruns"), experiment="bench", timeout_s=600)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="sleep this long between exports (a step's other work, GIL free); each export() is "
                         "timed alone. 0: exports back to back, where a writer thread competes for the GIL")
    ap.add_argument("--arms", default=None, help="comma-separated arms to run (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ampguard-exp-")
    k = [0]

    def jsonl(**kw: Any) -> JsonlExporter:
        k[0] += 1
        return JsonlExporter(os.path.join(tmp, f"e{k[0]}.jsonl"), **kw)

    arms = {
        "null": lambda: [],
        "prometheus": lambda: [PrometheusExporter(port=0, addr="127.0.0.1")],
        "jsonl": lambda: [jsonl()],
        "jsonl_anomalies": lambda: [jsonl(every_step=False)],
        "both": lambda: [PrometheusExporter(port=0, addr="127.0.0.1"), jsonl()],
        "otel": _otel,
        "wandb": lambda: _wandb(tmp),
        "mlflow": lambda: _mlflow(tmp),
    }
    chosen = args.arms.split(",") if args.arms else list(arms)
    unknown = sorted(set(chosen) - set(arms))
    if unknown:
        ap.error(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(arms)}")
    res = {"ampguard": os.path.dirname(ampguard.__file__), "n": args.n, "repeat": args.repeat, "gap_us": args.gap_us,
           "loadavg": os.getloadavg(), "arms": {}}
    for name in chosen:
        make = arms[name]
        res["arms"][name] = time_arm(make, args.n, args.repeat, args.gap_us * 1e-6)
        print(f"{name:11s} {res['arms'][name]['us_per_export']:8.2f} us/export on the step   "
              f"+{res['arms'][name]['drain_us_per_export']:8.2f} us/export drained after", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
