"""kfac-pytorch's hyperparameter schedules."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["exp_decay_factor_averaging"]


def exp_decay_factor_averaging(min_value: float = 0.95) -> Callable[[int], float]:
    """``factor_decay`` as a function of the step ``k``: ``min(1 − 1/k, min_value)``.

    The first factor update (``k`` = 0 counts as 1) then keeps no weight on the
    identity start, and later ones average the batches seen so far until the weight
    reaches ``min_value`` (Martens & Grosse 2015).
    """
    if isinstance(min_value, bool) or not isinstance(min_value, (int, float)) or min_value <= 0:
        raise ValueError(f"Invalid min_value={min_value!r}: must be a number > 0.")

    def factor_decay(step: int) -> float:
        if step < 0:
            raise ValueError(f"Invalid step={step!r}: must be >= 0.")
        return min(1.0 - 1.0 / max(step, 1), float(min_value))

    return factor_decay
