"""Stop 53: why the Lightning arm of frameworks_cost.py never captured its measurement graph (captures 0 at stops 52
and 53, against 9 for accelerate and transformers). Runs the three guarded framework arms for a few blocks and
prints, per arm, how many distinct gradient-address keys its steps measured, the key sequence, and the measurement
graph's state (failed, credit, misses, kept). Run:
    PYTHONPATH=$PWD python benchmarks/results/gpu_stop53/lightning_keys.py [cuda|cpu] [FRAMEWORKS]

FRAMEWORKS: frameworks_cost.py's list (default accelerate,transformers,lightning: six models' loops interleaved, as
the benchmark runs them). Run it twice, with the default and with ``lightning`` alone (two loops): the six-model
interleaving moves every gradient between blocks, and Lightning zeroes the gradients after its forward, not before
(its closure: training_step, zero_grad, backward), so the previous step's gradients are alive during the forward;
whether its keys repeat without the others tells whether the benchmark or Lightning keeps the graph out.
"""
import collections
import runpy
import sys
import threading
import warnings
from pathlib import Path

root = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(root), str(root / "benchmarks")]
import ampguard.decision_graph as D  # noqa: E402
import ampguard.pipeline as P  # noqa: E402

log: dict[str, list] = collections.defaultdict(list)
graphs: dict[str, object] = {}
orig_run = D.MeasureGraph.run


def run(self, kind, fn, grads, scale=None):  # type: ignore[no-untyped-def]
    name = threading.current_thread().name
    key = (kind, grads[0].dtype, 0 if scale is None else scale.data_ptr(), len(grads),
           *map(lambda g: g.data_ptr(), grads))
    log[f"{name}:{self.what}:{kind}"].append(hash(key))
    graphs[f"{name}:{self.what}"] = self
    return orig_run(self, kind, fn, grads, scale)


D.MeasureGraph.run = run
orig_replayed = P.StepPipeline._replayed
why: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def replayed(self, kind, measure, groups, scale=None, graphs=None):  # type: ignore[no-untyped-def]
    devs = [str(d) for d, _ in groups.tensors]
    why[threading.current_thread().name][(kind if isinstance(kind, str) else str(kind)[:40], len(groups.tensors),
                                          groups.own, tuple(devs), str(self.device),
                                          None if scale is None else str(scale.device))] += 1
    return orig_replayed(self, kind, measure, groups, scale, graphs)


P.StepPipeline._replayed = replayed
warnings.simplefilter("always")
device = "cuda" if len(sys.argv) < 2 else sys.argv[1]
frameworks = "accelerate,transformers,lightning" if len(sys.argv) < 3 else sys.argv[2]
sys.argv = ["frameworks_cost.py", "--device", device, "--frameworks", frameworks,
            "--blocks", "3", "--block", "10", "--warmup", "1"] + (["--quick"] if device == "cpu" else [])
try:
    runpy.run_path(str(root / "benchmarks" / "frameworks_cost.py"), run_name="__main__")
except SystemExit:
    pass
for name, keys in sorted(log.items()):
    seen = list(dict.fromkeys(keys))
    print(name, "runs", len(keys), "distinct keys", len(seen), "sequence", [seen.index(k) for k in keys][:60])
for name, g in sorted(graphs.items()):
    print(name, {k: getattr(g, k, None) for k in ("enabled", "_failed", "credit", "misses", "captures", "replays")},
          "kept", len(getattr(g, "_graphs", {})), "seen", len(getattr(g, "_seen", {})))
for name, c in sorted(why.items()):
    print(name, "_replayed (kind, groups, own, devices, pipeline device, scale device):", dict(c))
