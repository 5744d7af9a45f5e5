"""Do two-rank gloo DDP runs exit cleanly, guarded and plain, under CPU load? (issue 15, item 8)

Each run starts 2 ranks as separate processes (as torchrun does), trains a tiny DDP model for a
few steps, tears down, and returns from ``main``. A run is **aborted** when a rank's exit status
is not 0 (SIGABRT from ``terminate called without an active exception`` is -6), and **hung** when
it has not ended within ``--timeout`` seconds. Variants, interleaved run by run so both see the
same load:

- ``plain``:   DDP + AdamW, ``loss.backward(); opt.step()``;
- ``guarded``: the same through ``ampguard.wrap`` (its DDP comm hook, a JSONL log and a
  Prometheus endpoint on 127.0.0.1, so the exporters' file and threads are alive at exit).

Teardowns (``--teardown``):

- ``naive``: what the issue's scenario did: ``dist.destroy_process_group()`` with the DDP model
  (and the guard, unclosed) still alive; they go at interpreter exit, after the group;
- ``safe``: ``opt.close()`` (guarded), ``del`` the optimizer and the DDP model, ``gc.collect()``,
  ``dist.barrier()``, then ``dist.destroy_process_group()``: nothing of DDP outlives the group.

Load: ``--load`` processes spinning on the CPU (``--load-nice``) for the whole measurement.

    python benchmarks/teardown.py --runs 50 --load 2 --out benchmarks/results/teardown_cpu.txt
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_ABORT_MARKERS = ("terminate called", "Aborted", "core dumped", "Fatal Python error", "Segmentation fault")


# ---------------------------------------------------------------------------------- one rank
def rank_main(rank: int, world: int, port: int, variant: str, teardown: str, outdir: str, steps: int) -> None:
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = inner
    if variant == "guarded":
        import ampguard
        from ampguard.exporters import JsonlExporter, PrometheusExporter

        opt = ampguard.wrap(inner, model=model, precision="bf16",
                            exporters=[JsonlExporter(Path(outdir) / "events.jsonl"),
                                       PrometheusExporter(port=0, addr="127.0.0.1")])
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        if variant == "guarded":
            with opt.autocast():
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            opt.backward(loss)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
    if teardown == "safe":
        if variant == "guarded":
            opt.close()
        del opt, inner, model
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()
    # naive: the DDP model (and the guard) are still alive here; they go at interpreter exit


# ---------------------------------------------------------------------------------- the measurement
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_run(variant: str, teardown: str, steps: int, timeout: float) -> tuple[str, float, list[str]]:
    """('ok' | 'aborted' | 'hung', seconds, per-rank notes)."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory() as outdir:
        start = time.monotonic()
        procs = []
        for rank in range(2):
            cmd = [sys.executable, __file__, "--rank-main", str(rank), "2", str(port), variant, teardown, outdir,
                   str(steps)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        notes, status = [], "ok"
        for rank, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
                status = "hung"
                notes.append(f"rank {rank}: killed after {timeout:g}s")
                continue
            text = err.decode(errors="replace")
            if p.returncode != 0:
                status = "aborted" if status == "ok" else status
                marker = next((m for m in _ABORT_MARKERS if m in text), "")
                last = text.strip().splitlines()[-1][:160] if text.strip() else ""
                notes.append(f"rank {rank}: exit {p.returncode} {marker!r} {last!r}")
        return status, time.monotonic() - start, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="runs per variant (default 50)")
    ap.add_argument("--variants", default="plain,guarded")
    ap.add_argument("--teardown", choices=("naive", "safe"), default="naive")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2, help="CPU-spinning processes (default: cores)")
    ap.add_argument("--load-nice", type=int, default=0, help="niceness of the spinning processes")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds before a run counts as hung")
    ap.add_argument("--budget", type=float, default=None, help="stop starting runs after this many seconds")
    ap.add_argument("--out", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")

    import torch

    lines = [
        f"# benchmarks/teardown.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"# command: python {' '.join(sys.argv)}",
        f"# torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} cores; load: {args.load} spinning process(es) at nice {args.load_nice}; "
        f"teardown: {args.teardown}; {args.steps} steps per run",
    ]
    print("\n".join(lines), flush=True)
    spin = f"import os\nos.nice({args.load_nice})\nwhile True:\n    pass\n"
    burners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(args.load)]
    counts = {v: {"ok": 0, "aborted": 0, "hung": 0} for v in variants}
    seconds = {v: 0.0 for v in variants}
    began = time.monotonic()
    try:
        for i in range(args.runs):
            if args.budget is not None and time.monotonic() - began > args.budget:
                lines.append(f"# budget of {args.budget:g}s spent: stopped after {i} run(s) per variant")
                print(lines[-1], flush=True)
                break
            for variant in (variants if i % 2 == 0 else variants[::-1]):
                status, took, notes = _one_run(variant, args.teardown, args.steps, args.timeout)
                counts[variant][status] += 1
                seconds[variant] += took
                line = f"run {i:3d} {variant:8s} {status:8s} {took:6.1f}s" + ("  " + "; ".join(notes) if notes else "")
                lines.append(line)
                print(line, flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    lines.append("# summary (runs: aborted / hung / total, mean seconds per run)")
    for v in variants:
        n = sum(counts[v].values())
        lines.append(f"{v:8s} aborted {counts[v]['aborted']}/{n}  hung {counts[v]['hung']}/{n}  "
                     f"mean {seconds[v] / max(n, 1):.1f}s")
    print("\n".join(lines[-1 - len(variants):]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        r, w, port, variant, teardown, outdir, steps = sys.argv[2:9]
        rank_main(int(r), int(w), int(port), variant, teardown, outdir, int(steps))
    else:
        sys.exit(main())
