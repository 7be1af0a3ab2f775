"""What the token dump computes for one sampled response, in plain PyTorch (no verl, no process group).

:func:`token_stats` turns the logits of a response's positions into p, H, the closed-form gradient
norm and the top-5 alternatives; :func:`build_records` turns them into validated records of
:mod:`stapo_core.token_records`. :func:`select_responses` picks which responses are dumped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from stapo_core import entropy_from_logits, logit_grad_norm, token_records as td

TOP_K = 5
#: response positions whose float32 softmax is materialised at once (151,936 x 1024 x 4 B = 0.6 GB)
CHUNK_POSITIONS = 1024


def select_responses(advantages: Sequence[float], k: int, seed: Sequence[int]) -> list[int]:
    """Indices (ascending) of up to ``k`` responses to dump, drawn with ``numpy.random.default_rng(seed)``.

    ``min(k // 4, #non-positive)`` come from responses with advantage <= 0 and the rest from
    positive ones; a pool that is short is topped up from the other, so ``min(k, len)`` are drawn.

    Args:
        advantages: one float per response (its scalar advantage).
        k: responses wanted (>= 1). seed: e.g. ``(step, rank)``.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"select_responses: k={k!r} must be an integer >= 1")
    adv = np.asarray(advantages, dtype=np.float64).reshape(-1)
    positive, other = np.flatnonzero(adv > 0), np.flatnonzero(~(adv > 0))
    n_other = min(len(other), k // 4)
    n_pos = min(len(positive), k - n_other)
    n_other = min(len(other), k - n_pos)
    rng = np.random.default_rng([int(s) for s in seed])
    picked = np.concatenate([rng.choice(positive, n_pos, replace=False), rng.choice(other, n_other, replace=False)])
    return sorted(int(i) for i in picked)


def token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_k: int = TOP_K,
                chunk_size: int = CHUNK_POSITIONS) -> dict[str, torch.Tensor]:
    """Per-position statistics of the sampled tokens, in float32, ``chunk_size`` positions at a time.

    Args:
        logits: ``(T, V)`` any float dtype: the logits predicting each sampled token.
        targets: ``(T,)`` integer ids of the sampled tokens.
        temperature: the logits are divided by it (as verl does for log-probs), > 0.
        top_k: alternatives kept per position (capped at V).

    Returns:
        ``log_prob``, ``prob``, ``entropy`` (nats), ``grad_norm`` (sqrt(1 - 2 p + sum p^2)): ``(T,)``
        float32; ``top_prob`` ``(T, k)`` float32 (descending) and ``top_ids`` ``(T, k)`` int64.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"token_stats: logits (T, V) and targets (T,) expected, got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"token_stats: temperature={temperature!r} must be a positive number")
    k = min(top_k, logits.shape[1])
    parts: dict[str, list] = {name: [] for name in ("log_prob", "entropy", "grad_norm", "top_prob", "top_ids")}
    for start in range(0, max(logits.shape[0], 1), chunk_size):  # T = 0: one empty chunk, empty stats
        a = logits[start : start + chunk_size].float() / temperature
        tgt = targets[start : start + chunk_size].to(a.device).long()
        lse = torch.logsumexp(a, -1)
        top_val, top_ids = a.topk(k, -1)
        parts["log_prob"].append(a.gather(-1, tgt[:, None]).squeeze(-1) - lse)
        parts["entropy"].append(entropy_from_logits(a))
        parts["grad_norm"].append(logit_grad_norm(a, tgt))
        parts["top_prob"].append(torch.exp(top_val - lse[:, None]))
        parts["top_ids"].append(top_ids)
    out = {name: torch.cat(chunks) for name, chunks in parts.items()}
    out["prob"] = out["log_prob"].exp()
    return out


@dataclass
class SampledResponse:
    """One sampled response, everything on the host.

    prompt_ids / response_ids: unpadded token ids. stats: :func:`token_stats` over the response
    positions (``(R,)`` / ``(R, k)``). mask: ``(R,)`` the original response mask (1 = response
    token). advantages: ``(R,)``. silenced: ``(R,)`` bool. old_log_prob: ``(R,)`` rollout log-probs
    (for the agreement check). uid / response_index / rank / row: identity. dlogp: ``(R,)`` the
    change of each token's log-prob across the update (None until measured).
    """

    prompt_ids: list
    response_ids: list
    stats: dict
    mask: torch.Tensor
    advantages: torch.Tensor
    silenced: torch.Tensor
    old_log_prob: Optional[torch.Tensor]
    uid: str
    response_index: int
    rank: int
    row: int
    dlogp: Optional[torch.Tensor] = None

    @property
    def advantage(self) -> float:
        """The response's advantage: mean over its mask tokens (GRPO: the shared scalar)."""
        m = self.mask != 0
        return float(self.advantages[m].double().mean()) if bool(m.any()) else 0.0


def build_records(resp: SampledResponse, *, step: int, method: str, tau_p: float, tau_h: Optional[float],
                  context: int, decode: Callable[[list], str], extra: Optional[dict] = None,
                  ids: bool = False) -> list[dict]:
    """The token records of ``resp``'s candidates, then its response record (validated dicts).

    Candidates: mask != 0, advantage > 0, ``prob < tau_p`` (p from ``resp.stats``). Context: up to
    ``context`` tokens before the token (prompt included) and after it (within the response),
    decoded with ``decode(list_of_ids) -> str``. ``extra`` keys are added to every record;
    ``ids`` adds ``prompt_ids`` / ``response_ids`` to the response record.
    """
    s = resp.stats
    prob, entropy, grad_norm = s["prob"], s["entropy"], s["grad_norm"]
    full = list(resp.prompt_ids) + list(resp.response_ids)
    n_prompt, n_resp = len(resp.prompt_ids), len(resp.response_ids)
    extra = dict(extra or {}, rank=resp.rank, row=resp.row)
    candidate = (resp.mask != 0) & (resp.advantages > 0) & (prob < tau_p)
    records = []
    for pos in torch.nonzero(candidate).reshape(-1).tolist():
        at = n_prompt + pos
        records.append(td.validate_token_record({
            "kind": "token", "step": step, "method": method, "uid": resp.uid,
            "response_index": resp.response_index, "position": pos, "token_id": int(full[at]),
            "token": decode([full[at]]), "context_before": decode(full[max(0, at - context) : at]),
            "context_after": decode(full[at + 1 : min(n_prompt + n_resp, at + 1 + context)]),
            "prob": float(prob[pos]), "entropy": max(float(entropy[pos]), 0.0),
            "advantage": float(resp.advantages[pos]), "candidate": True, "silenced": bool(resp.silenced[pos]),
            "grad_norm": float(grad_norm[pos]),
            "dlogp": None if resp.dlogp is None else float(resp.dlogp[pos]),
            "top5": [[decode([int(i)]), min(max(float(p), 0.0), 1.0)]
                     for p, i in zip(s["top_prob"][pos].tolist(), s["top_ids"][pos].tolist())],
            **extra,
        }))
    rec = td.response_record(step=step, method=method, uid=resp.uid, response_index=resp.response_index,
                             advantage=resp.advantage, prob=prob, entropy=entropy.clamp(min=0.0),
                             grad_norm=grad_norm, mask=resp.mask, tau_p=tau_p, tau_h=tau_h, dlogp=resp.dlogp)
    rec.update(extra)
    if ids:
        rec.update(prompt_ids=[int(i) for i in resp.prompt_ids], response_ids=[int(i) for i in resp.response_ids])
    records.append(rec)
    return records
