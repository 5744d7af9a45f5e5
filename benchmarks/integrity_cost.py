"""What issue 27's checks cost, side by side in one process (docs/integrity.md).

- ``param_check_every``: guarded GPT-2 steps with the parameter check off, every 10 steps (the
  default) and every step, in interleaved blocks; per-block ratios against the check off, p25/median/p75.
- The replicas' digest (``ampguard.fingerprint.params_digest``, what ``consistency_every`` compares
  across ranks): one pass over every parameter in chunks, timed alone (median of ``--reps``), and as a
  fraction of a step at N=100 (``consistency_every=100``: one pass per 100 steps); and the
  per-parameter fingerprints (``verify()``, and a mismatch's second exchange).
- ``opt.verify()``: the whole verdict (max|x| of weights and optimizer state, fingerprints, one read).

    python benchmarks/integrity_cost.py --device cuda --model gpt2 --blocks 20 --out results.json
    python benchmarks/integrity_cost.py --device cpu --model mlp --blocks 10       # a smoke run here
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead

import ampguard
from ampguard.fingerprint import param_fingerprints, params_digest


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=None, choices=sorted(overhead.SIZES))
    p.add_argument("--blocks", type=int, default=20)
    p.add_argument("--block", type=int, default=10, help="steps per block")
    p.add_argument("--reps", type=int, default=20, help="timed fingerprint / verify passes")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    size = overhead.SIZES[args.model or ("gpt2" if device.type == "cuda" else "mlp")]
    batch = overhead.make_batch(size, device)
    dtype = torch.bfloat16
    arms = {}
    for name, every in (("off", None), ("every10", 10), ("every1", 1)):
        model = overhead.build_model(size, device)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
        opt = ampguard.wrap(inner, model=model, precision="bf16", config={"param_check_every": every})
        arms[name] = (model, opt)

    def block(name: str, steps: int) -> float:
        model, opt = arms[name]
        _sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            with torch.autocast(device.type, dtype=dtype):
                loss = overhead.compute_loss(model, batch)
            opt.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
        _sync(device)
        return (time.perf_counter() - t) / steps

    for name in arms:  # warm-up
        block(name, 3)
    times: dict[str, list[float]] = {n: [] for n in arms}
    for b in range(args.blocks):
        order = list(arms) if b % 2 == 0 else list(reversed(arms))
        for name in order:
            times[name].append(block(name, args.block))
    ratios = {n: [t / o for t, o in zip(times[n], times["off"])] for n in ("every10", "every1")}
    step_ms = statistics.median(times["off"]) * 1e3

    model, opt = arms["off"]
    params = [q for q in model.parameters()]
    fp_ms, per_param_ms, verify_ms = [], [], []
    for _ in range(args.reps):
        for fn, into in ((params_digest, fp_ms), (param_fingerprints, per_param_ms)):
            _sync(device)
            t = time.perf_counter()
            fn(params)
            _sync(device)
            into.append((time.perf_counter() - t) * 1e3)
    for _ in range(max(3, args.reps // 4)):
        _sync(device)
        t = time.perf_counter()
        opt.verify()
        verify_ms.append((time.perf_counter() - t) * 1e3)
    fp = statistics.median(fp_ms)
    result = {
        "command": "python benchmarks/integrity_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "model": args.model or ("gpt2" if device.type == "cuda" else "mlp"),
        "params": sum(q.numel() for q in params), "step_ms_median": step_ms,
        "param_check_ratio": {n: _quartiles(r) for n, r in ratios.items()},
        "fingerprint_ms": _quartiles(fp_ms), "fingerprint_fraction_of_a_step_at_n100": fp / (100 * step_ms),
        "per_parameter_fingerprints_ms": _quartiles(per_param_ms),
        "verify_ms": _quartiles(verify_ms),
    }
    print(f"{result['model']} on {result['device']}, torch {result['torch']}: "
          f"step {step_ms:.2f} ms (median, check off)")
    for n, (a, m, c) in result["param_check_ratio"].items():
        print(f"  param_check_every={n[5:]:>2}: guard/check-off p25 {a:.4f}  median {m:.4f}  p75 {c:.4f}")
    a, m, c = result["fingerprint_ms"]
    print(f"  one fingerprint pass: {m:.3f} ms (p25 {a:.3f}, p75 {c:.3f}); at N=100: "
          f"{100 * result['fingerprint_fraction_of_a_step_at_n100']:.4f} % of a step")
    print(f"  per-parameter fingerprints (verify(), a mismatch's second exchange): "
          f"{result['per_parameter_fingerprints_ms'][1]:.3f} ms median")
    print(f"  verify(): {result['verify_ms'][1]:.2f} ms median")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
