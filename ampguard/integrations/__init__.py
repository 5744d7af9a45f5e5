"""Integrations with the frameworks people train in. Each submodule imports its framework; this
package imports none of them.

- :mod:`ampguard.integrations.accelerate`: ``ampguard.wrap(prepared, accelerator=accelerator)``.
- :mod:`ampguard.integrations.transformers`: ``GuardedTrainer``.
- :mod:`ampguard.integrations.lightning`: ``AmpGuardPrecision``.
- :mod:`ampguard.integrations.dcp`: ``torch.distributed.checkpoint`` (``get_state_dict``, ``set_state_dict``).
"""
