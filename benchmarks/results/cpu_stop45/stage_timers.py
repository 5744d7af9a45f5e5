"""Stop 45: thread time of named ampguard functions inside mlp-small steps (README.md here).

argv: fused|foreach, then module:Qual,... (e.g. outcome:Outcome.settle)."""

import importlib
import pkgutil
import statistics
import sys
import time
import warnings

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")  # run from the repository root
import overhead as ov  # noqa: E402

import ampguard  # noqa: E402

mods = [
    importlib.import_module("ampguard." + m.name)
    for m in pkgutil.walk_packages(ampguard.__path__)
    if not m.name.startswith(("cli", "demo", "dashboards", "preflight"))
]
ACC = {}
clock = time.thread_time_ns


def wrapfn(fn, label):
    acc = ACC.setdefault(label, [0, 0])

    def timed(*a, **k):
        t0 = clock()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += clock() - t0
            acc[1] += 1

    timed.__wrapped__ = fn
    return timed


TARGETS = sys.argv[2].split(",")
for t in TARGETS:
    modname, qual = t.rsplit(":", 1)
    mod = importlib.import_module("ampguard." + modname)
    if "." in qual:
        cls, meth = qual.split(".")
        c = getattr(mod, cls)
        setattr(c, meth, wrapfn(getattr(c, meth), qual))
    else:
        fn = getattr(mod, qual)
        w = wrapfn(fn, qual)
        for m in mods:
            if getattr(m, qual, None) is fn:
                setattr(m, qual, w)
size = ov.SIZES["mlp-small"]
dev = torch.device("cpu")
batch = ov.make_batch(size, dev)
m = ov.build_model(size, dev)
fused = sys.argv[1] == "fused"
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.1, **({"fused": True} if fused else {"foreach": True}))
sc = torch.amp.GradScaler("cpu", init_scale=4096)
g = ampguard.wrap(opt, model=m, scaler=sc, precision="fp16")
N = 1500
steps = []
for i in range(N + 100):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ov.compute_loss(m, batch)
    g.backward(loss)
    if i == 100:
        for a in ACC.values():
            a[0] = a[1] = 0
    t0 = clock()
    g.step()
    steps.append(clock() - t0)
    g.zero_grad(set_to_none=True)
print("step median", statistics.median(steps[100:]) / 1e3)
for k, (t, n) in sorted(ACC.items(), key=lambda x: -x[1][0]):
    print(f"{k:40s} {t / N / 1e3:8.1f} us/step  {n / N:5.2f} calls/step")
