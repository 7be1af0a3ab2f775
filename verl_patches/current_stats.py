"""S2T statistics under the policy being updated (``stats_from=current``, the paper's Algorithm 1).

* :func:`current_policy_statistics`: ``(log_prob, entropy)`` of a mini-batch under the current
  policy, from one no-grad forward through verl's own inference pass (mini-batch scope; called by
  :mod:`verl_patches.mini_batch` for every mini-batch of a step after the first).
* :func:`wrap_set_loss_fn`: with the micro-batch scope, the update's own forward supplies the
  entropy; when it serves only as S2T's statistic (no entropy bonus), it is computed without
  autograd.
"""

from __future__ import annotations

import functools
import math

import torch

#: attribute marking an engine's entropy function as already running without autograd
NO_GRAD_MARK = "_stapo_no_grad"


def current_policy_statistics(worker, data) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_prob, entropy)`` of the mini-batch's response tokens under the policy being updated:
    one no-grad forward through verl's own inference path (``TrainingWorker.infer_batch``, the pass
    that computes the old log-probs, with its micro-batch and token-budget settings), on a shallow
    copy of the mini-batch so that nothing verl adds to it leaks into the update. Returned padded
    ``(batch, max_response_len)``, as verl's loss sees them."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    view = data.copy()
    engine_config = worker.engine_config
    micro = engine_config.infer_micro_batch_size_per_gpu or len(data)
    tu.assign_non_tensor(  # the inference pass's settings (a micro-batch size that divides the mini-batch)
        view, calculate_entropy=True, compute_loss=False, use_dynamic_bsz=engine_config.use_dynamic_bsz,
        max_token_len_per_gpu=engine_config.infer_max_token_len_per_gpu,
        micro_batch_size_per_gpu=math.gcd(int(micro), len(data)),
    )
    output = worker.infer_batch(view)
    return no_padding_2_padding(output["log_probs"], data), no_padding_2_padding(output["entropy"], data)


def statistic_only_entropy(actor_config) -> bool:
    """True when the update's entropy serves only S2T's current statistics (no entropy bonus)."""
    from .config import TokenSelectionLossConfig

    policy_loss = getattr(actor_config, "policy_loss", None)
    return (
        isinstance(policy_loss, TokenSelectionLossConfig)
        and policy_loss.needs_update_entropy
        and actor_config.entropy_coeff == 0
    )


def wrap_set_loss_fn(set_loss_fn):
    """``TrainingWorker.set_loss_fn`` that, when :func:`statistic_only_entropy` holds for the loss's
    config, makes the engine compute the update's entropy under ``torch.no_grad``: otherwise autograd
    keeps every chunk's float32 softmax over the vocabulary for a backward that contributes nothing
    (benchmarks/README.md measures 2.6x -> 1.0x peak memory of the loss path)."""

    @functools.wraps(set_loss_fn)  # keeps verl's dispatch attributes
    def wrapped(self, loss_fn, *args, **kwargs):
        result = set_loss_fn(self, loss_fn, *args, **kwargs)
        config = getattr(loss_fn, "keywords", {}).get("config")
        if statistic_only_entropy(config):
            engine = self.engine
            if not getattr(engine.compute_entropy_from_logits, NO_GRAD_MARK, False):
                no_grad_entropy = torch.no_grad()(engine.compute_entropy_from_logits)
                setattr(no_grad_entropy, NO_GRAD_MARK, True)
                engine.compute_entropy_from_logits = no_grad_entropy
        return result

    return wrapped
