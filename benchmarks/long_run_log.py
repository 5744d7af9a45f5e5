#!/usr/bin/env python
"""Write the event logs of a long synthetic run: 20,000 steps on 2 ranks, fp16, 200 anomalies.

A guarded run that long is too slow to train for a picture or a test, so this writes what one
would log, through the real :class:`~ampguard.exporters.JsonlExporter` (``every_step=True``) fed
with real :class:`~ampguard.StepReport` and :class:`~ampguard.Anomaly` records, in the guard's
own words: dynamic loss scaling (growth every ``growth_interval`` clean steps, a backoff on each
overflow), a decaying loss with noise, overflow bursts, one-rank NaNs localised to a module, loss
and gradient-norm spikes, transient NaNs, and one dense stretch where anomalies come every few
steps (what an unstable phase looks like, and what a picture's notes must survive).

    python benchmarks/long_run_log.py --out runs/long          # then: ampguard report runs/long --plot long.png

Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ampguard.exporters import JsonlExporter
from ampguard.records import Anomaly, RunInfo, StepReport
from ampguard.vocab import AnomalyKind, Cause, Phase, SkipReason

LAYERS = 12
GROWTH_INTERVAL = 100
MAX_SCALE = 2.0**16
PARAMS = tuple(f"blocks.{i}.{p}" for i in range(LAYERS) for p in ("attn.qkv.weight", "mlp.0.weight", "mlp.2.weight"))


def plan(steps: int, anomalies: int, rng: random.Random) -> dict[int, str]:
    """Step -> what goes wrong there: ``anomalies`` events in all (a 3-step overflow burst counts 3),
    a tenth of them packed into one dense stretch at about 60% of the run."""
    kinds = ["overflow"] * 6 + ["loss_spike"] * 2 + ["grad_spike"] * 1 + ["one_rank_nan"] + ["transient"]
    out: dict[int, str] = {}
    dense = anomalies // 10
    start = int(steps * 0.6)
    for i in range(dense):  # an unstable phase: one every ~4 steps
        out[start + 4 * i] = "overflow" if i % 3 else "loss_spike"
    while len(out) < anomalies:
        s = rng.randrange(20, steps - 1)
        if any(t in out for t in range(s - 3, s + 4)):
            continue
        kind = rng.choice(kinds)
        if kind == "overflow" and rng.random() < 0.3 and len(out) + 3 <= anomalies:
            for t in range(s, s + 3):  # a burst: three overflows in a row
                out[t] = "overflow"
        else:
            out[s] = kind
    # The last step goes wrong too: its note sits at the figure's right edge.
    out.pop(max(out))
    out[steps - 1] = "transient"
    return out


def write(out: str | os.PathLike[str], steps: int = 20_000, anomalies: int = 200, ranks: int = 2,
          seed: int = 0) -> Path:
    """Write ``events-rank{R}.jsonl`` for each rank under ``out``; returns the directory."""
    rng = random.Random(seed)
    events = plan(steps, anomalies, rng)
    out_dir = Path(out)
    exporters = [JsonlExporter(str(out_dir) + "/", every_step=True) for _ in range(ranks)]
    for r, e in enumerate(exporters):
        e.open(RunInfo(run_id=f"synthetic-{steps}", rank=r, local_rank=r, world_size=ranks, precision="fp16",
                       backend="torch.distributed", device="cpu", param_names=PARAMS,
                       versions=(("ampguard", "synthetic"),), loss_scale_floor=2.0**-14))
    scale, clean = 65536.0, 0
    loss_avg = None
    for step in range(steps):
        what = events.get(step)
        loss = 2.0 + 6.0 * math.exp(-step / 4000) + rng.gauss(0, 0.04)
        norm = 0.4 * math.exp(-step / 12000) * math.exp(rng.gauss(0, 0.25))
        fields: dict[str, object] = {}
        found: list[Anomaly] = []
        layer = rng.randrange(LAYERS)
        if what == "overflow":
            nxt = scale / 2
            found.append(Anomaly(step, AnomalyKind.OVERFLOW,
                                 f"2 gradient tensor(s) non-finite at loss scale {scale:g} (first: blocks.{layer}."
                                 f"mlp.2.weight); step skipped; loss scale backed off {scale:g} -> {nxt:g}",
                                 tuple(range(ranks)), (f"blocks.{layer}.mlp.2.weight",), f"blocks.{layer}.mlp",
                                 Phase.BACKWARD, Cause.OVERFLOW))
            fields = {"skipped": True, "reason": SkipReason.NONFINITE_GRAD, "grad_norm": math.inf,
                      "nonfinite_grads": 2, "nonfinite_ranks": tuple(range(ranks)), "next_loss_scale": nxt,
                      "scale_backoff": True}
        elif what == "one_rank_nan":
            found.append(Anomaly(step, AnomalyKind.NONFINITE_GRAD,
                                 f"1 gradient tensor(s) non-finite (first: blocks.{layer}.attn.qkv.weight) on "
                                 f"rank(s) [{ranks - 1}]; step skipped; loss scale kept at {scale:g}",
                                 (ranks - 1,), (f"blocks.{layer}.attn.qkv.weight",), f"blocks.{layer}.attn",
                                 Phase.BACKWARD, Cause.NAN))
            fields = {"skipped": True, "reason": SkipReason.NONFINITE_GRAD, "grad_norm": math.nan,
                      "nonfinite_grads": 1, "nonfinite_ranks": (ranks - 1,)}
        elif what == "transient":
            found.append(Anomaly(step, AnomalyKind.NONFINITE_LOSS,
                                 "loss was nan on rank(s) [0]; step skipped; loss scale held; a replay of the same "
                                 "batch was clean: suspect hardware or a race", (0,), (), f"blocks.{layer}",
                                 Phase.FORWARD, Cause.TRANSIENT))
            fields = {"skipped": True, "reason": SkipReason.NONFINITE_LOSS, "loss": math.nan,
                      "grad_norm": math.nan, "nonfinite_loss": True, "nonfinite_grads": 3, "nonfinite_ranks": (0,)}
        elif what == "loss_spike":
            loss *= 2.2
            found.append(Anomaly(step, AnomalyKind.LOSS_SPIKE,
                                 f"loss {loss:.4g} exceeded 1.5x its running average; "
                                 "step taken (Spikes.action='warn')"))
            fields = {"loss_spike": True}
        elif what == "grad_spike":
            norm *= 40
            found.append(Anomaly(step, AnomalyKind.GRAD_SPIKE,
                                 f"gradient norm {norm:.4g} exceeded 10.0x its running average; step skipped"))
            fields = {"skipped": True, "reason": SkipReason.GRAD_SPIKE, "grad_spike": True}
        skipped = bool(fields.get("skipped"))
        nxt = float(fields.pop("next_loss_scale", scale))  # type: ignore[arg-type]
        if not skipped:
            clean += 1
            if clean == GROWTH_INTERVAL:
                clean = 0
                if scale < MAX_SCALE:  # GuardConfig's ceiling
                    nxt = scale * 2
                    fields["scale_growth"] = True
        else:
            clean = 0
        loss_avg = loss if loss_avg is None else 0.98 * loss_avg + 0.02 * loss
        for r, e in enumerate(exporters):
            base = {"step": step, "skipped": False, "reason": None, "loss": loss, "loss_scale": scale,
                    "next_loss_scale": nxt, "grad_norm": norm, "nonfinite_grads": 0, "nonfinite_loss": False,
                    "world_size": ranks, "rank": r, "wall_time": 1.7e9 + 0.25 * step}
            e.export(StepReport(**{**base, **fields}), found)  # type: ignore[arg-type]
        scale = nxt
    for e in exporters:
        e.close()
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the event logs (one file per rank)")
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--anomalies", type=int, default=200)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write(args.out, args.steps, args.anomalies, args.ranks, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
