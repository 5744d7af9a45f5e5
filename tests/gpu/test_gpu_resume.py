"""On CUDA: a resumed run (state_dict round trip) continues bit for bit, with the decision
replayed from a CUDA graph captured after the resume (fused; a non-fused optimizer's step is
decided on the host), through hysteresis and spike state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ampguard
from ampguard import faults

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _build(fused: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).cuda()
    kw = {"fused": True} if fused else {"foreach": True}
    opt = ampguard.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3, **kw), model=model,
                        scaler=torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=5),
                        config={"hysteresis": 2, "spikes": {"grad_factor": 50.0, "warmup": 3}})
    faults.inject(opt, faults.grad("2.weight", "inf", steps=[6, 9, 10]))
    return model, opt


def _train(model, opt, batches):
    for x, y in batches:
        with opt.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
    opt.flush()


def _decided_in_a_graph(opt) -> bool:
    """The decision ran from a CUDA graph: the decision's own, or the step graph's (on by default since stop 40)."""
    pipe = opt._pipeline
    return not pipe.host_decision and (pipe.graph._graph is not None or pipe.step_graph.replays > 0)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_resume_bit_for_bit_with_cuda_graph(fused):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=g).cuda(), torch.randint(0, 4, (16,), generator=g).cuda())
               for _ in range(24)]  # 14 steps after the resume: the step graph's keys settle and replay
    model_a, opt_a = _build(fused)
    _train(model_a, opt_a, batches)
    assert _decided_in_a_graph(opt_a)  # fused or not, since stop 55 (a non-fused step reads the decision's skip)
    assert not opt_a._pipeline.host_decision

    model_b, opt_b = _build(fused)
    # stops with the allowance spent (6 and 9 overflowed since the growth at step 4): step 10 backs
    # off only if the resumed guard restored that
    _train(model_b, opt_b, batches[:10])
    saved_model = {k: v.clone() for k, v in model_b.state_dict().items()}
    saved = opt_b.state_dict()
    assert saved["ampguard"]["overflow_run"] == 2

    model_c, opt_c = _build(fused)
    model_c.load_state_dict(saved_model)
    opt_c.load_state_dict(saved)
    _train(model_c, opt_c, batches[10:])
    for a, c in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(a, c)
    assert _decided_in_a_graph(opt_c), (opt_c._pipeline.step_graph.replays, opt_c._pipeline.step_graph.misses)
    tail_a = [(r.skipped, r.loss_scale, r.next_loss_scale) for r in list(opt_a.history)[10:]]
    tail_c = [(r.skipped, r.loss_scale, r.next_loss_scale) for r in opt_c.history]
    assert tail_a == tail_c
    assert opt_a.state_dict()["ampguard"] == opt_c.state_dict()["ampguard"]
