"""The one switch for the core's caches: ``$MERIDIAN_PLAIN_PATHS=1`` takes the plain path in
each of them (the tracker's steady and bulk ways, :class:`~meridian.core.rows.SteadyRows`, the
planner's lazy and moot orders): the oracle their tests compare against, and a way to rule them
out in the field. Read once, when a policy is built."""

from __future__ import annotations

import os

__all__ = ["ENV_PLAIN_PATHS", "plain_paths"]

ENV_PLAIN_PATHS = "MERIDIAN_PLAIN_PATHS"


def plain_paths() -> bool:
    """Whether the caches are off (``$MERIDIAN_PLAIN_PATHS`` is ``1``)."""
    return os.environ.get(ENV_PLAIN_PATHS, "") == "1"
