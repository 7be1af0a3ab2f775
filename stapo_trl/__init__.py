"""STAPO's S2T in TRL's ``GRPOTrainer`` (docs/trl.md), from the same :mod:`stapo_core`.

* :class:`STAPOConfig`: TRL's ``GRPOConfig`` plus S2T's ``tau_p``, ``q``, ``strategy`` and ``current_forward``;
* :class:`STAPOTrainer`: TRL's ``GRPOTrainer`` with the S2T keep mask in its loss;
* :func:`s2t_window`: the mask over the micro-batches of one optimizer step (torch + stapo_core).

Imports ``stapo_core``, torch, TRL, transformers and accelerate only (never the verl recipe).
Installed with the ``trl`` extra: ``pip install -e .[trl]``.
"""

from .config import STAPOConfig
from .selection import s2t_window
from .trainer import STAPOTrainer

__all__ = ["STAPOConfig", "STAPOTrainer", "s2t_window"]
