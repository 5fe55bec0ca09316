"""A stand-in for the one Ray call a resident worker makes to find its peers, on a cluster where
the peer it asks for is not running (Ray 2.60.0, the release installed here).

Copied behaviour: ``ray.get_actor(name, namespace=None)`` (``python/ray/_private/worker.py``) of an
actor that does not exist raises ``ValueError("Failed to look up actor with name '<name>'. This
could because 1. You are trying to look up a named actor you didn't create. 2. The named actor
died. 3. You did not use a namespace matching the namespace of the actor.")``. ``is_initialized()``
answers False (``rft_core.weightsync.collective.host_address`` then meets on 127.0.0.1).

Not modelled: everything else of Ray (no actor, task or object store): a test that needs more
starts a real Ray. Installed for one test by ``install(monkeypatch)``; every lookup is recorded in
``lookups``.
"""
from __future__ import annotations

import sys
import types


def install(monkeypatch) -> types.ModuleType:
    """Make ``import ray`` find this stand-in for the rest of the test; returns the module."""
    module = types.ModuleType("ray")
    module.lookups = []

    def get_actor(name: str, namespace: str | None = None):
        module.lookups.append((name, namespace))
        raise ValueError(f"Failed to look up actor with name '{name}'. This could because 1. You are trying to look up "
                         "a named actor you didn't create. 2. The named actor died. 3. You did not use a namespace "
                         "matching the namespace of the actor.")

    module.get_actor = get_actor
    module.is_initialized = lambda: False
    monkeypatch.setitem(sys.modules, "ray", module)
    return module
