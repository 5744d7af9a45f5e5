"""Forensics: where a non-finite value came from (module, phase, rank) and why.

- :mod:`.arming`: when the guard arms and disarms the localizer, and what a finding annotates;
- :mod:`.localizer`: the hooks that find the first module whose output went non-finite;
- :mod:`.calls`: a module call as saved (copies of its stateful arguments);
- :mod:`.recompute`: the cause, by recomputing the culprit in the run's precision and in fp32;
- :mod:`.sentinel`: the coarse per-block check that runs before anything is armed;
- :mod:`.compile`: ``torch.compile`` awareness (user module names, eager while armed, re-tracing a hooked module).
"""
