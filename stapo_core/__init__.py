"""STAPO's math in plain PyTorch (no verl import).

* :func:`s2t_mask`: S2T, the keep mask that silences spurious tokens (and the paper's ablations);
  :func:`s2t_candidates`: its candidate set;
* :func:`entropy_topk_mask`: 20-Entropy's top-``ratio`` highest-entropy tokens (``entropy_topk``);
* :mod:`stapo_core.rules`: the table of token-selection rules every layer reads;
* :func:`entropy_from_logits`, :func:`logit_grad_norm`, :func:`grad_norm_bounds`: the paper's
  gradient-norm identity and bounds.

Statistics pooled over a ``torch.distributed`` group use :mod:`stapo_core.distributed`. Also here,
because every layer shares them and none of them needs verl: the token-dump record format
(:mod:`stapo_core.token_records`) and the one way files are written (:mod:`stapo_core.fileio`).
"""

from .checks import is_number
from .entropy_topk import entropy_topk_mask
from .grad_norm import entropy_from_logits, grad_norm_bounds, logit_grad_norm
from .s2t import DEFAULT_Q, DEFAULT_TAU_P, STRATEGIES, S2TResult, quantile_sorted_padded, s2t_candidates, s2t_mask

__all__ = [
    "DEFAULT_Q",
    "DEFAULT_TAU_P",
    "STRATEGIES",
    "S2TResult",
    "entropy_from_logits",
    "entropy_topk_mask",
    "grad_norm_bounds",
    "is_number",
    "logit_grad_norm",
    "quantile_sorted_padded",
    "s2t_candidates",
    "s2t_mask",
]
