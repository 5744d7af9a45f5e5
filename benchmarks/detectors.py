#!/usr/bin/env python
"""The three gradient-norm detectors compared on one recorded run with spikes (issue 17, item 4).

1. **Record.** A small MLP regresses a fixed random teacher network (CPU, seeded, bf16 autocast,
   AdamW), with a healthy noise floor (label noise, batch sampling) and spikes at known steps:
   *bad batches* (the targets of one batch times ``--bad-factor``: a corrupted shard) and *LR
   bursts* (the learning rate times ``--burst-factor`` for one step: a scheduler bug; the spike
   shows in the gradient of the steps after it). The guard runs with no detector, so nothing is
   skipped or clipped, and logs every step with the real ``JsonlExporter``.
2. **Replay.** The per-step gradient-norm series is read back from that event log
   (``ampguard.runlog.load_run``) and fed, step by step, through the library's own decision
   (``ampguard.policies.decide_host``, the CPU path, bit for bit ``decide``) under each detector:
   ``factor`` (``Spikes(grad_factor=...)``), ``zscore`` (``Spikes(grad_zscore=...)``) and ZClip
   (``zclip=ZClip()``), with ``action="warn"`` so the replayed statistics see what the recorded
   run saw. Per detector: spikes caught (of the known ones: a bad batch at its step, an LR burst
   within ``BURST_LAG`` steps after it), steps flagged in a known spike's aftermath
   (``AFTERMATH`` steps: the damaged model's own large gradients), false positives (flags
   anywhere else), steps flagged; for ZClip, per known spike, the share of its norm let through.
3. **Live.** Training again from the same seed with each detector acting (factor and z-score with
   ``action="skip"``, ZClip clipping, and none): the final loss on a held-out set, the longest
   run of skipped steps (at most ``warmup``: a detector re-bases its statistics after that
   many flags in a row) and the steps where a detector re-baselined.

    python benchmarks/detectors.py --out benchmarks/results/detectors_cpu
    python benchmarks/detectors.py --quick --out /tmp/detectors_quick   # seconds; used by the tests

Writes ``<out>.json`` and ``<out>.md`` (the table, with the command that made it); with
``--keep-log`` also the recorded event log, ``<out>.events.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ampguard
from ampguard import runlog
from ampguard.config import GuardConfig
from ampguard.exporters import JsonlExporter
from ampguard.policies import SpikeState, decide_host
from ampguard.scaling import ScaleState
from ampguard.stats import LOCAL_K, Dec, Loc
from ampguard.vocab import AnomalyKind

BURST_LAG = 3
"""An LR burst at step s counts as caught when a step in s+1..s+BURST_LAG is flagged."""
AFTERMATH = 10
"""Flags within this many steps after a known spike are counted apart, not as false positives."""
WARMUP = 20

DETECTORS: dict[str, dict[str, Any]] = {
    "factor": {"spikes": {"grad_factor": 3.0, "decay": 0.98}},
    "zscore": {"spikes": {"grad_zscore": 4.0, "window": 50}},
    "zclip": {"zclip": {"z": 2.5, "alpha": 0.97}},
}
"""Each detector's settings (the library's defaults where it has them; 3.0 for the factor)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    steps: int
    bad_batches: tuple[int, ...]
    lr_bursts: tuple[int, ...]
    bad_factor: float
    burst_factor: float
    batch: int = 32
    lr: float = 3e-3
    seed: int = 0

    def events(self) -> list[tuple[str, int]]:
        return sorted([("bad_batch", s) for s in self.bad_batches] + [("lr_burst", s) for s in self.lr_bursts],
                      key=lambda e: e[1])


FULL = Plan(steps=600, bad_batches=(150, 260, 380, 470, 540), lr_bursts=(200, 420), bad_factor=30.0,
            burst_factor=100.0)
QUICK = Plan(steps=120, bad_batches=(50, 100), lr_bursts=(75,), bad_factor=30.0, burst_factor=100.0)


# ---------------------------------------------------------------------------------- the task
def _with(cfg: dict[str, Any], part: str, **fields: Any) -> dict[str, Any]:
    """``{part: {**fields, **cfg[part]}}`` when ``cfg`` sets ``part`` (``"spikes"``, ``"zclip"``), else ``{}``."""
    return {part: {**fields, **cfg[part]}} if part in cfg else {}


def _task(plan: Plan) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, ...]]:
    """A fresh student (same seed every time), the training batches (bad ones corrupted), an eval set."""
    g = torch.Generator().manual_seed(plan.seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g))

    def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 16, generator=g)
        with torch.no_grad():
            y = teacher(x) + 0.1 * torch.randn(n, 1, generator=g)  # label noise: the healthy floor
        return x, y

    batches = [sample(plan.batch) for _ in range(plan.steps)]
    for s in plan.bad_batches:
        x, y = batches[s]
        batches[s] = (x, y * plan.bad_factor)
    evalset = sample(1024)
    torch.manual_seed(plan.seed + 1)
    student = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                  torch.nn.Linear(64, 1))
    return student, batches, evalset


def train(plan: Plan, config: dict[str, Any], exporters: list[Any] | None = None) -> dict[str, Any]:
    """One guarded run of the plan; the LR bursts applied. Returns its reports and the eval loss."""
    model, batches, (ex, ey) = _task(plan)
    inner = torch.optim.AdamW(model.parameters(), lr=plan.lr)
    opt = ampguard.wrap(inner, model=model, precision="bf16", config=config, exporters=exporters or [])
    for step, (x, y) in enumerate(batches):
        for group in inner.param_groups:
            group["lr"] = plan.lr * (plan.burst_factor if step in plan.lr_bursts else 1.0)
        with opt.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
    opt.flush()
    reports = list(opt.history)
    rebaselines = [a.step for a in opt.anomalies if a.kind == AnomalyKind.REBASELINE]
    opt.close()
    with torch.no_grad():
        eval_loss = float(torch.nn.functional.mse_loss(model(ex), ey))
    return {"reports": reports, "eval_loss": eval_loss, "rebaselines": rebaselines}


# ---------------------------------------------------------------------------------- replay
def replay(norms: list[float], losses: list[float], config: GuardConfig) -> list[list[float]]:
    """The decision vectors ``decide_host`` gives for this norm series, step by step, carrying its
    statistics as the guard does (one rank, no loss scaling)."""
    spikes, scale_state = SpikeState.fresh(torch.device("cpu")), ScaleState.fresh(torch.device("cpu"))
    out = []
    for norm, loss in zip(norms, losses):
        row = [0.0] * LOCAL_K
        row[Loc.LOSS], row[Loc.GRAD_NORM], row[Loc.SENTINEL] = loss, norm, -1.0
        if not math.isfinite(norm):
            row[Loc.NONFINITE_TENSORS] = 1.0
        gathered = torch.tensor([row], dtype=torch.float32)
        decision, _ = decide_host(gathered, config=config, spikes=spikes, scale_state=scale_state, scaler=None,
                                  grads_sharded=False)
        out.append(decision)
    return out


def score(name: str, decisions: list[list[float]], norms: list[float], plan: Plan) -> dict[str, Any]:
    flag = Dec.CLIP_COEF if name == "zclip" else Dec.GRAD_SPIKE
    flagged = [s for s, d in enumerate(decisions) if (d[flag] < 1.0 if name == "zclip" else d[flag] > 0)]
    caught, spikes = [], []
    aftermath: set[int] = set()
    for kind, s in plan.events():
        window = [s] if kind == "bad_batch" else list(range(s + 1, s + 1 + BURST_LAG))
        hit = [t for t in window if t in flagged]
        caught.append({"kind": kind, "step": s, "caught": bool(hit), "flagged_at": hit})
        aftermath.update(range(s, s + 1 + max(AFTERMATH, BURST_LAG)))
        if name == "zclip":
            peak = max(window, key=lambda t: norms[t])
            d = decisions[peak]
            coef = d[Dec.CLIP_COEF]
            spikes.append({"kind": kind, "step": peak, "norm": norms[peak], "let_through": norms[peak] * coef,
                           "share_let_through": coef})
    out: dict[str, Any] = {
        "caught": sum(c["caught"] for c in caught), "known": len(caught), "events": caught,
        "false_positives": sorted(set(flagged) - aftermath), "aftermath_flags": sorted(set(flagged) & aftermath),
        "steps_flagged": len(flagged),
    }
    if spikes:
        out["spikes"] = spikes
    return out


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="120 steps, 3 known spikes (seconds)")
    ap.add_argument("--out", default="benchmarks/results/detectors_cpu", help="output prefix (.json, .md)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-log", action="store_true", help="also write the recorded event log, <out>.events.jsonl")
    args = ap.parse_args(argv)
    plan = dataclasses.replace(QUICK if args.quick else FULL, seed=args.seed)
    torch.set_num_threads(1)
    started = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    # 1. record
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "events.jsonl"
        recorded = train(plan, {}, exporters=[JsonlExporter(log, every_step=True)])
        run = runlog.load_run(log)
        reports = run.ranks[0].reports
        if args.keep_log:
            Path(f"{out}.events.jsonl").write_text(log.read_text())
    norms, losses = [r.grad_norm for r in reports], [r.loss for r in reports]
    assert len(norms) == plan.steps and norms == [r.grad_norm for r in recorded["reports"]]

    # 2. replay
    base = {"spikes": {"warmup": WARMUP, "action": "warn"}}
    replayed = {name: score(name, replay(norms, losses, GuardConfig.from_dict(
        {**cfg, **_with(cfg, "zclip", warmup=WARMUP), **_with(cfg, "spikes", **base["spikes"])})), norms, plan)
                for name, cfg in DETECTORS.items()}

    # 3. live
    live_cfgs: dict[str, dict[str, Any]] = {"none": {}}
    for name, cfg in DETECTORS.items():
        live_cfgs[name] = {**cfg, **_with(cfg, "zclip", warmup=WARMUP),
                           **_with(cfg, "spikes", warmup=WARMUP, action="skip"),
                           "max_consecutive_skips": None}  # a run of skips is what this measures: never stop it
    live = {}
    for name, cfg in live_cfgs.items():
        res = train(plan, cfg)
        live[name] = {"eval_loss": res["eval_loss"], "skipped": sum(r.skipped for r in res["reports"]),
                      "longest_skip_run": _longest_run([r.skipped for r in res["reports"]]),
                      "clipped": sum(r.clip_coef < 1.0 for r in res["reports"]), "rebaselines": res["rebaselines"],
                      "config": cfg}

    healthy = [n for s, n in enumerate(norms) if all(not (e <= s < e + AFTERMATH) for _, e in plan.events())]
    result = {
        "command": "python benchmarks/detectors.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "plan": dataclasses.asdict(plan), "detectors": DETECTORS, "warmup": WARMUP, "burst_lag": BURST_LAG,
        "aftermath": AFTERMATH, "healthy_norm_median": sorted(healthy)[len(healthy) // 2],
        "spike_norms": {f"{k}@{s}": max(norms[s:s + 1 + BURST_LAG]) for k, s in plan.events()},
        "replay": replayed, "live": live,
        "versions": {"ampguard": ampguard.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "seconds": round(time.perf_counter() - started, 2),
    }
    Path(f"{out}.json").write_text(json.dumps(result, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(result))
    print(markdown(result))
    return result


def _longest_run(flags: list[bool]) -> tuple[int, int | None]:
    """The longest run of True, and the step it starts at (None: no True)."""
    best, start, cur = 0, None, 0
    for step, f in enumerate(flags):
        cur = cur + 1 if f else 0
        if cur > best:
            best, start = cur, step - cur + 1
    return best, start


def markdown(r: dict[str, Any]) -> str:
    plan = r["plan"]
    lines = [
        "# Spike detectors compared (CPU)", "",
        f"Command: `{r['command']}` ({r['seconds']} s; torch {r['versions']['torch']}).", "",
        f"Run: {plan['steps']} steps, MLP student of a random teacher, AdamW lr {plan['lr']}, batch {plan['batch']}, "
        f"bf16 autocast, seed {plan['seed']}. Known spikes: bad batches (targets x{plan['bad_factor']:g}) at "
        f"{list(plan['bad_batches'])}, LR bursts (x{plan['burst_factor']:g} for one step) at "
        f"{list(plan['lr_bursts'])}. "
        f"Healthy gradient-norm median {r['healthy_norm_median']:.3g}. Warm-up {r['warmup']} steps for every detector.",
        "",
        "## Replay of the recorded gradient norms (`decide_host`, action=\"warn\")", "",
        "| detector | settings | spikes caught | false positives | aftermath flags | steps flagged |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in r["replay"].items():
        settings = ", ".join(f"{k}={v}" for k, v in r["detectors"][name].items())
        lines.append(f"| {name} | {settings} | {s['caught']}/{s['known']} | {len(s['false_positives'])} "
                     f"| {len(s['aftermath_flags'])} | {s['steps_flagged']} |")
    lines += ["", f"Caught: a bad batch flagged at its step, an LR burst within {r['burst_lag']} steps after it. "
              f"Aftermath: flags within {r['aftermath']} steps after a known spike (the damaged model's own large "
              "gradients); false positives: flags anywhere else. For ZClip, flagged = clipped.", "",
              "ZClip, per known spike (the largest norm of its window):", "",
              "| spike | step | norm | let through | share |", "|---|---|---|---|---|"]
    for sp in r["replay"]["zclip"].get("spikes", []):
        lines.append(f"| {sp['kind']} | {sp['step']} | {sp['norm']:.4g} | {sp['let_through']:.4g} "
                     f"| {sp['share_let_through']:.3g} |")
    lines += ["", "## Live: trained with each detector acting", "",
              "| detector | action | held-out loss at the end | steps skipped | longest run of skips (from step) "
              "| steps clipped | re-baselined at |", "|---|---|---|---|---|---|---|"]
    for name, s in r["live"].items():
        action = "none" if name == "none" else ("clip" if name == "zclip" else "skip")
        length, start = s["longest_skip_run"]
        run = f"{length} ({start})" if length else "0"
        rebased = ", ".join(map(str, s["rebaselines"])) or "-"
        lines.append(f"| {name} | {action} | {s['eval_loss']:.4g} | {s['skipped']} | {run} "
                     f"| {s['clipped']} | {rebased} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
