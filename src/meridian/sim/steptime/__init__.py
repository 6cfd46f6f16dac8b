"""How long one engine step takes: the simulator's only notion of cost.

The engine describes a step as a :class:`BatchShape` and asks a :class:`StepTimeModel` for its
duration in integer nanoseconds. Two models ship:

- :class:`RooflineStepTime`: analytic, from a :class:`HardwareSpec` and a :class:`ModelSpec`
  (see :mod:`meridian.sim.presets`). A step is bound either by arithmetic or by HBM traffic.
- :class:`FittedStepTime`: a linear model least-squares fitted to step times measured on the
  user's own hardware (``from_csv``), for when the roofline's assumptions do not hold.

Both are pure functions of the batch: no wall clock, no randomness. One module per part:
:mod:`.base` (the batch and the protocol), :mod:`.roofline`, :mod:`.fitted`.
"""

from meridian.sim.steptime.base import BatchShape, CalibrationError, StepTimeModel
from meridian.sim.steptime.fitted import CSV_COLUMNS, FittedStepTime
from meridian.sim.steptime.roofline import (
    Bound,
    HardwareSpec,
    ModelSpec,
    RooflineStepTime,
    StepBreakdown,
)

__all__ = [
    "CSV_COLUMNS",
    "BatchShape",
    "Bound",
    "CalibrationError",
    "FittedStepTime",
    "HardwareSpec",
    "ModelSpec",
    "RooflineStepTime",
    "StepBreakdown",
    "StepTimeModel",
]
