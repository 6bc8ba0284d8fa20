"""Validation of user-facing arguments: a ``ValueError`` naming the parameter and the allowed values."""

from __future__ import annotations

import math
from typing import Callable, Optional


def check_density(density: float, parameter: str = "density") -> float:
    """Validate a density in (0, 1]."""
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not (0.0 < float(density) <= 1.0) \
            or math.isnan(float(density)):
        raise ValueError(f"`{parameter}` must be a number in (0, 1], got {density!r}")
    return float(density)


def check_int(value: int, parameter: str, low: int, high: Optional[int] = None) -> int:
    """Validate an integer in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ValueError(f"`{parameter}` must be {allowed}, got {value!r}")
    return value


def check_bool(value: bool, parameter: str) -> bool:
    """Validate a boolean (strings such as ``"no"`` are refused, not read as True)."""
    if not isinstance(value, bool):
        raise ValueError(f"`{parameter}` must be True or False, got {value!r}")
    return value


def check_number(value: float, parameter: str, allowed: str, test: Callable[[float], bool]) -> float:
    """Validate a number (not a bool) that passes ``test``, as a float; ``allowed`` says which in the error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not test(value):
        raise ValueError(f"`{parameter}` must be {allowed}, got {value!r}")
    return float(value)
