"""Algorithms as pure functions chosen by name: advantage estimators, policy losses, off-policy correction."""
from __future__ import annotations


def helpers_needed(cfg) -> tuple[str, ...]:
    """The helper models (molt/actor/helpers.py) a run needs: its estimator's, then its objective's."""
    from molt.algo.advantages import ESTIMATORS
    from molt.algo.loss import Objective

    return tuple(ESTIMATORS[cfg.estimator.name].helpers) + Objective.from_config(cfg).needs
