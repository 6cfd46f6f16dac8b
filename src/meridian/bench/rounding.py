"""Report floats rounded to 6 significant digits, so that a report does not change with the last
bits of a float sum: :func:`round_sig`, and :data:`Sig6`, the field type every float of a report
schema has (rounded on construction and on reload)."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator

__all__ = ["SIGNIFICANT_DIGITS", "Sig6", "round_sig"]

SIGNIFICANT_DIGITS = 6


def round_sig(value: float, digits: int = SIGNIFICANT_DIGITS) -> float:
    """``value`` rounded to ``digits`` significant digits (idempotent).

    >>> round_sig(0.123456789)
    0.123457
    >>> round_sig(123456789.0)
    123457000.0
    """
    if not math.isfinite(value):
        raise ValueError(f"a report value must be finite; got {value}")
    if value == 0.0:
        return 0.0
    return float(f"{value:.{digits}g}")


def _round_field(value: float) -> float:
    return round_sig(float(value))


# Every float in the report schema goes through this, on construction and on reload.
Sig6 = Annotated[float, AfterValidator(_round_field)]
