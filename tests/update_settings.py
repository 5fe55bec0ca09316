"""``ppo_update``'s settings in the unit tests: the config sections the update stage passes."""
from __future__ import annotations

from typing import Any

from rft_core.config import KLConfig, UpdateConfig
from rft_core.training.update import UpdateSettings


def update_settings(*, kl: KLConfig | None = None, temperature: float = 1.0, policy_version: int = 0,
                    **update: Any) -> UpdateSettings:
    """``UpdateSettings`` of ``UpdateConfig(**update)`` with padded micro-batches unless ``packing``
    is given (``UpdateConfig`` packs by default; the unit tests' numbers are of padded rows), the
    ``kl`` section (None: no KL term), the rollout ``temperature`` and the ``policy_version`` the
    update starts from.

    Raises:
        pydantic.ValidationError: ``update`` is not a valid ``update`` section.
    """
    return UpdateSettings(UpdateConfig(**{"packing": False, **update}), kl or KLConfig(), temperature=temperature,
                          policy_version=policy_version)
