"""A guarded run whose event log hits a real write failure for a while (issue 15, item 6).

Run as ``python -m tests.unit._disk_full_run LOG``: after step 4 the process's file-size limit
(``RLIMIT_FSIZE``) is set just above the log's size, so the kernel fails the log's writes as a
full disk does (a write cut short, then ``EFBIG`` on every write); after step 14 the limit is
lifted, as when space is freed. Prints what the Prometheus endpoint said meanwhile, as JSON.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import urllib.request

import torch

import ampguard
from ampguard import faults
from ampguard.exporters import JsonlExporter, MultiExporter, PrometheusExporter

from ._models import loss_of, make_data, make_model, make_opt

NAN_AT = [2, 6, 9, 12, 20, 30, 40]
FULL_AFTER, FREED_AFTER, STEPS = 4, 14, 45


def _health(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("ampguard_exporter_") and 'exporter="JsonlExporter"' in line:
            out[line.split("{")[0]] = float(line.split()[-1])
    return out


def main(log: str) -> None:
    MultiExporter.RETRY_FIRST_S = MultiExporter.RETRY_MAX_S = 0.0  # retry on every step: a short test
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal, as a full disk gives ENOSPC
    model = make_model()
    prom = PrometheusExporter(port=0, addr="127.0.0.1")
    log_ = JsonlExporter(log, every_step=False)  # the anomalies and skipped steps only
    opt = ampguard.wrap(make_opt(model), model=model, precision="fp32", exporters=[log_, prom])
    data = make_data(STEPS)
    seen = {}
    with faults.inject(opt, model, faults.loss("nan", steps=NAN_AT)):
        for step, (x, y) in enumerate(data):
            opt.backward(loss_of(model, x, y))
            opt.step()
            opt.zero_grad()
            if step == FULL_AFTER:
                resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(log) + 100, resource.RLIM_INFINITY))
            if step == FREED_AFTER - 1:
                seen["while_full"] = _health(prom.url)
            if step == FREED_AFTER:
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    seen["after"] = _health(prom.url)
    opt.close()
    print(json.dumps(seen))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
