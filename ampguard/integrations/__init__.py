"""Integrations with the frameworks people train in. Each submodule imports its framework; this
package imports none of them.

- :mod:`ampguard.integrations.accelerate`: ``ampguard.wrap()`` of an ``AcceleratedOptimizer``.
- :mod:`ampguard.integrations.transformers`: ``GuardedTrainer``.
- :mod:`ampguard.integrations.lightning`: ``AmpGuardPrecision``.
"""
