"""Training-time dump of the S2T candidate tokens of a few sampled responses (issue 6).

Off by default. ``recipe.token_dump.dir=<run folder>`` turns it on for any method (baselines too,
so their spurious tokens can be inspected); the recipe passes the settings to every Ray worker as
environment variables:

=============================  ================================  =========================================
variable                       config key                        meaning
=============================  ================================  =========================================
``STAPO_TOKEN_DUMP_DIR``       ``recipe.token_dump.dir``         run folder; empty = off
``STAPO_TOKEN_DUMP_RESPONSES`` ``recipe.token_dump.responses``   responses sampled per data-parallel rank and step (>= 1)
``STAPO_TOKEN_DUMP_CONTEXT``   ``recipe.token_dump.context``     tokens of context each side of a token (>= 0)
``STAPO_TOKEN_DUMP_IDS``       ``recipe.token_dump.ids``         ``true``: response records also carry
                                                                 ``prompt_ids`` / ``response_ids`` (for exact
                                                                 offline re-scoring; larger files)
``STAPO_TOKEN_DUMP_METHOD``    ``recipe.method``                 ``method`` written in the records
                                                                 (default: the policy loss mode)
=============================  ================================  =========================================

What is written, once per training step, to ``<dir>/s2t_tokens/step_XXXXXX.jsonl``
(:func:`recipe.stapo.token_dump.step_file`, records of :mod:`recipe.stapo.token_dump`; data-parallel
rank 0 writes the records of every rank, so the folder only needs to exist on its node; a step
file is replaced atomically, so a resumed run rewrites the steps it trains again):

* one ``response`` record per sampled response: advantage, token count, ``tau_p`` / ``tau_h`` and
  the four probability x entropy quadrants over its response tokens
  (:func:`recipe.stapo.token_dump.response_record`, so the numbers come from one place);
* one ``token`` record per *candidate* token (inside the response mask, advantage > 0,
  ``p < tau_p``): token text, position in the response, ``context`` tokens of context each side
  (decoded with the model's tokenizer), p, entropy, advantage, the closed-form logit-gradient norm
  ``sqrt(1 - 2 p + sum p^2)`` (:func:`stapo_core.logit_grad_norm`), the policy's top-5 alternatives
  with probabilities and ``silenced`` (carried no gradient in this update).

Where the numbers come from:

* Only the FIRST mini-batch of each step is dumped: its policy is the rollout policy, so p and H
  are the ones S2T used (``old_log_probs``). The actor runs one extra no-grad forward per sampled
  response (batch of one, prompt + response, no padding) through the FSDP module, keeps only the
  response positions' logits (``logits_to_keep``) and computes p, H, top-5 and the gradient norm in
  float32, ``CHUNK_POSITIONS`` positions at a time, at the rollout temperature. The largest gap
  between these p and ``exp(old_log_probs)`` is logged as ``token_dump/max_prob_diff``.
* ``tau_p``: the policy loss's ``tau_p`` (S2T methods), else the paper's 0.002. ``q``: the loss's
  ``q``, else 0.75.
* ``tau_h``: S2T's entropy threshold of the mini-batch, recomputed with :func:`stapo_core.s2t_mask`
  on exactly what the fold used (``old_log_probs``, the rollout ``entropy`` field, ``advantages``,
  the original response mask, pooled over the data-parallel group): it equals the fold's
  ``s2t/tau_h`` of that mini-batch (the logged ``actor/s2t/tau_h`` is the mean over the step's
  mini-batches). Strategy: the loss's own when it is ``low_entropy`` / ``high_entropy``, else
  ``low_entropy`` (baselines, ``random``, ``full``: what STAPO would have used). When the
  mini-batch holds no rollout ``entropy`` (legacy trainer, non-S2T methods), it is computed the
  same way over the sampled responses of every rank with the dump's own p and H
  (``tau_h_source = "sampled"`` in the response records, else ``"mini_batch"``).
* ``silenced``: from the mask the update used (original response mask 1, folded mask 0: exact for
  STAPO and 20-Entropy with ``scope=mini_batch``; never for the baselines). With S2T inside the
  loss (``scope=micro_batch``) the mask is not visible here, so the ``s2t_mask`` recomputation
  over the mini-batch stands in for it (``silenced_from = "s2t_recomputed"``, approximate: the
  loss pools per micro-batch); otherwise ``silenced_from = "update_mask"``.

Sampling (seeded by step and data-parallel rank, :func:`select_responses`): up to ``K`` responses
per rank; a quarter of them (``K // 4``) from responses with advantage <= 0 when there are any
(they have no candidates but fill the quadrant table), the rest from positive-advantage ones, each
pool topped up from the other when short. Every rank runs the same number of forwards (FSDP
forwards are collective): a rank with fewer responses repeats its first one and discards it.

Step number: the actor's lr-scheduler count + 1 (one scheduler step per training step, restored
with checkpoints), else a per-process count of dumped steps. The first mini-batch is the first
call of the process or the one after verl's ``update_lr_scheduler`` (last mini-batch) flag.

Returned metrics (logged as ``actor/token_dump/...``): ``seconds`` (this rank's wall time of the
dump), ``records`` (written for the step, all ranks), ``responses`` (sampled, all ranks),
``max_prob_diff``. Non-first mini-batches return ``{}`` and cost nothing.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

#: run folder; empty or unset: the dump is off
DIR_ENV = "STAPO_TOKEN_DUMP_DIR"
RESPONSES_ENV = "STAPO_TOKEN_DUMP_RESPONSES"
CONTEXT_ENV = "STAPO_TOKEN_DUMP_CONTEXT"
IDS_ENV = "STAPO_TOKEN_DUMP_IDS"
METHOD_ENV = "STAPO_TOKEN_DUMP_METHOD"
DEFAULT_RESPONSES = 4
DEFAULT_CONTEXT = 16
#: the paper's S2T defaults, used for methods whose loss config has no tau_p / q
DEFAULT_TAU_P = 0.002
DEFAULT_Q = 0.75
TOP_K = 5
#: response positions whose float32 softmax is materialised at once (151,936 x 1024 x 4 B = 0.6 GB)
CHUNK_POSITIONS = 1024
METRIC_PREFIX = "token_dump/"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def enabled() -> bool:
    """True when ``STAPO_TOKEN_DUMP_DIR`` is set and non-empty."""
    return bool(os.environ.get(DIR_ENV, ""))


# --------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DumpSettings:
    """run_dir: the run folder; responses: K per rank; context: tokens each side; ids: store the
    sequences' token ids in the response records; method: the records' ``method`` (None: loss mode)."""

    run_dir: Path
    responses: int = DEFAULT_RESPONSES
    context: int = DEFAULT_CONTEXT
    ids: bool = False
    method: Optional[str] = None


def _int_setting(env: Mapping[str, str], name: str, key: str, default: int, minimum: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"token dump: {key}={raw!r} (env {name}) must be an integer >= {minimum}") from None
    if value < minimum:
        raise ValueError(f"token dump: {key}={value} (env {name}) must be an integer >= {minimum}")
    return value


def settings_from_env(env: Optional[Mapping[str, str]] = None) -> DumpSettings:
    """The dump's settings from the environment (default ``os.environ``).

    Raises:
        ValueError: the dump is off, or a malformed value (names the config key and the variable).
    """
    env = os.environ if env is None else env
    run_dir = env.get(DIR_ENV, "")
    if not run_dir:
        raise ValueError(f"token dump is off: set recipe.token_dump.dir (env {DIR_ENV}) to a run folder")
    ids = env.get(IDS_ENV, "").strip().lower()
    if ids not in _TRUE + _FALSE:
        raise ValueError(f"token dump: {IDS_ENV}={env.get(IDS_ENV)!r} must be one of 1/0/true/false")
    return DumpSettings(
        run_dir=Path(run_dir),
        responses=_int_setting(env, RESPONSES_ENV, "recipe.token_dump.responses", DEFAULT_RESPONSES, 1),
        context=_int_setting(env, CONTEXT_ENV, "recipe.token_dump.context", DEFAULT_CONTEXT, 0),
        ids=ids in _TRUE,
        method=env.get(METHOD_ENV) or None,
    )


# --------------------------------------------------------------------------------------------
# pure pieces (no verl, no process group)
# --------------------------------------------------------------------------------------------


class MiniBatchTracker:
    """Tells the first mini-batch of each update step, per process.

    verl's ``train_mini_batch`` flags its last mini-batch with ``update_lr_scheduler=True``; the
    first is the process's first call or the call after a flagged one (robust to any number of
    mini-batches and PPO epochs).
    """

    def __init__(self) -> None:
        self._next_is_first = True
        self.steps_seen = 0

    def observe(self, is_last: bool) -> bool:
        """Record one mini-batch (``is_last``: verl's flag); True when it is a step's first."""
        first = self._next_is_first
        self._next_is_first = bool(is_last)
        self.steps_seen += int(first)
        return first


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
    from stapo_core import entropy_from_logits, logit_grad_norm

    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"token_stats: logits (T, V) and targets (T,) expected, got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"token_stats: temperature={temperature!r} must be a positive number")
    k = min(top_k, logits.shape[1])
    parts: dict[str, list] = {name: [] for name in ("log_prob", "entropy", "grad_norm", "top_prob", "top_ids")}
    for start in range(0, logits.shape[0], chunk_size):
        a = logits[start : start + chunk_size].float() / temperature
        tgt = targets[start : start + chunk_size].to(a.device).long()
        lse = torch.logsumexp(a, -1)
        top_val, top_ids = a.topk(k, -1)
        parts["log_prob"].append(a.gather(-1, tgt[:, None]).squeeze(-1) - lse)
        parts["entropy"].append(entropy_from_logits(a))
        parts["grad_norm"].append(logit_grad_norm(a, tgt))
        parts["top_prob"].append(torch.exp(top_val - lse[:, None]))
        parts["top_ids"].append(top_ids)
    if not parts["log_prob"]:  # T = 0
        empty = logits.new_zeros(0, dtype=torch.float32)
        return {"log_prob": empty, "prob": empty, "entropy": empty, "grad_norm": empty,
                "top_prob": logits.new_zeros((0, k), dtype=torch.float32),
                "top_ids": torch.zeros((0, k), dtype=torch.long, device=logits.device)}
    out = {name: torch.cat(chunks) for name, chunks in parts.items()}
    out["prob"] = out["log_prob"].exp()
    return out


@dataclass
class SampledResponse:
    """One sampled response, everything on the host.

    prompt_ids / response_ids: unpadded token ids. stats: :func:`token_stats` over the response
    positions (``(R,)`` / ``(R, k)``). mask: ``(R,)`` the original response mask (1 = response
    token). advantages: ``(R,)``. silenced: ``(R,)`` bool. old_log_prob: ``(R,)`` rollout log-probs
    (for the agreement check). uid / response_index / rank / row: identity.
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
    from recipe.stapo import token_dump as td

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
            "top5": [[decode([int(i)]), min(max(float(p), 0.0), 1.0)]
                     for p, i in zip(s["top_prob"][pos].tolist(), s["top_ids"][pos].tolist())],
            **extra,
        }))
    rec = td.response_record(step=step, method=method, uid=resp.uid, response_index=resp.response_index,
                             advantage=resp.advantage, prob=prob, entropy=entropy.clamp(min=0.0),
                             grad_norm=grad_norm, mask=resp.mask, tau_p=tau_p, tau_h=tau_h)
    rec.update(extra)
    if ids:
        rec.update(prompt_ids=[int(i) for i in resp.prompt_ids], response_ids=[int(i) for i in resp.response_ids])
    records.append(rec)
    return records


def write_step(run_dir: str | os.PathLike, step: int, records: list) -> Path:
    """Write ``records`` as the step's file (``step_file(run_dir, step)``), replacing it atomically.

    The records are validated and written to a temporary sibling first; a bad record raises
    ValueError and leaves any existing step file as it was.
    """
    from recipe.stapo import token_dump as td

    path = td.step_file(run_dir, step)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)
        td.write_records(tmp, records)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# --------------------------------------------------------------------------------------------
# verl glue: layouts, the forward, the collectives
# --------------------------------------------------------------------------------------------


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    from .token_selection import to_padded

    return to_padded(t, width)[:, :width]


def _response_lengths(data, width: int) -> list[int]:
    """Unpadded response length of each row: the jagged ``response_mask``'s row lengths (TransferQueue
    trainer) or the attention mask's count over the last ``width`` columns (legacy, right-padded)."""
    mask = data["response_mask"]
    if mask.is_nested:
        return mask.offsets().diff().tolist()
    if "attention_mask" not in data:
        raise KeyError("token dump: a padded response_mask needs the attention_mask field to find the responses")
    return data["attention_mask"][:, -width:].sum(-1).tolist()


def _scalar_setting(data, key: str, default):
    from verl.utils import tensordict_utils as tu

    value = tu.get(data, key, default)
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return default
        if not bool((value == value.reshape(-1)[0]).all()):
            raise ValueError(f"token dump: per-row {key} values differ; the dump supports one value per mini-batch")
        return value.reshape(-1)[0].item()
    return default if value is None else value


def _module_device(module: torch.nn.Module) -> torch.device:
    param = next(module.parameters())
    local = getattr(param, "_local_tensor", param)  # DTensor shard
    return local.device


def _autocast(engine, device: torch.device):
    """verl's FSDP engine's forward context: autocast to its compute dtype unless float32."""
    dtype = getattr(engine, "_autocast_dtype", torch.float32)
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def _response_logits(engine, input_ids: torch.Tensor, position_ids: torch.Tensor, n_resp: int,
                     device: torch.device) -> torch.Tensor:
    """``(n_resp, V)`` logits predicting the last ``n_resp`` tokens of one unpadded sequence.

    One forward of the engine's (FSDP) module with a batch of one and no padding
    (``attention_mask=None``, as verl's remove-padding path), under the engine's autocast, keeping
    only ``n_resp + 1`` positions of logits.
    """
    ids = input_ids.to(device).reshape(1, -1)
    pos = position_ids.to(device)
    pos = pos.reshape(1, -1) if pos.dim() == 1 else pos.unsqueeze(1)  # (4, L) mrope -> (4, 1, L)
    with _autocast(engine, device):
        out = engine.module(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
                            logits_to_keep=n_resp + 1)
    logits = getattr(out, "logits", None)
    if logits is None:
        raise ValueError("token dump: the actor module returned no logits (fused kernels? set "
                         "actor_rollout_ref.model.use_fused_kernels=false to use the token dump)")
    return logits[0, -(n_resp + 1) : -1]


def _loss_settings(cfg) -> tuple[float, float, str, bool]:
    """``(tau_p, q, strategy, s2t_in_loss)`` of the dump for the policy-loss config ``cfg``."""
    from .config import S2TPolicyLossConfig
    from .token_selection import uses_mini_batch_scope

    tau_p = float(getattr(cfg, "tau_p", DEFAULT_TAU_P))
    q = float(getattr(cfg, "q", DEFAULT_Q))
    is_s2t = isinstance(cfg, S2TPolicyLossConfig) and cfg.loss_mode == "stapo"
    strategy = cfg.strategy if is_s2t and cfg.strategy in ("low_entropy", "high_entropy") else "low_entropy"
    return tau_p, q, strategy, is_s2t and not uses_mini_batch_scope(cfg)


def _uids_and_indices(data, batch: int, step: int, rank: int) -> tuple[list, list]:
    """Group uid per row (verl's ``uid`` field, else ``s<step>r<rank>i<row>``) and each row's ordinal
    among the rows of this rank with the same uid."""
    from verl.utils import tensordict_utils as tu

    uids = tu.get(data, "uid", None)
    uids = [str(u) for u in uids] if uids is not None and len(uids) == batch else [
        f"s{step}r{rank}i{i}" for i in range(batch)]
    seen: dict = {}
    indices = []
    for u in uids:
        indices.append(seen.get(u, 0))
        seen[u] = indices[-1] + 1
    return uids, indices


class _Group:
    """The data-parallel group and the device its collectives use."""

    def __init__(self, group, device: torch.device):
        self.group, self.device = group, device
        dist = torch.distributed
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.active else 0
        self.size = dist.get_world_size(group) if self.active else 1

    def max(self, values: list) -> list:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.active and self.size > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def gather_objects(self, obj) -> list:
        if not (self.active and self.size > 1):
            return [obj]
        out = [None] * self.size
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out

    @property
    def s2t_group(self):
        return self.group if self.active else None


class _Decoder:
    """``decode(ids) -> str`` with the model's tokenizer, single tokens cached."""

    def __init__(self, tokenizer):
        if tokenizer is None:
            raise ValueError("token dump: the actor has no tokenizer (actor_rollout_ref.model.load_tokenizer)")
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, ids: list) -> str:
        if len(ids) == 1:
            key = int(ids[0])
            if key not in self.cache:
                self.cache[key] = self.tokenizer.decode([key], skip_special_tokens=False)
            return self.cache[key]
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False) if ids else ""


_tracker = MiniBatchTracker()


def _step_number(worker) -> int:
    """1-based training step: the actor's lr-scheduler count + 1, else the per-process count."""
    scheduler = getattr(getattr(worker, "engine", None), "lr_scheduler", None)
    last = getattr(scheduler, "last_epoch", None)
    return int(last) + 1 if isinstance(last, int) and last >= 0 else _tracker.steps_seen


def _check_supported(worker) -> None:
    engine = worker.engine
    if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
        raise ValueError("token dump: ulysses_sequence_parallel_size > 1 is not supported (the dump forwards "
                         "whole sequences); turn recipe.token_dump.dir off or sequence parallelism off")
    if not hasattr(engine, "module"):
        raise ValueError(f"token dump: engine {type(engine).__name__} has no module; only the FSDP engine is supported")


def dump_mini_batch(worker, data, response_mask: Optional[torch.Tensor], cfg) -> dict:
    """Dump the candidate tokens of a few sampled responses of this mini-batch (first of a step only).

    Called by ``verl_patches.install`` in verl's ``TrainingWorker.train_batch`` on every
    data-parallel rank, after the S2T / 20-Entropy mask was folded into ``data["response_mask"]``.

    Args:
        worker: verl's ``TrainingWorker`` (``engine.module``, ``engine.get_data_parallel_group()``,
            ``model_config.tokenizer``).
        data: the rank's mini-batch TensorDict (jagged or padded per-token fields).
        response_mask: the response mask before the fold (None: ``data["response_mask"]``).
        cfg: the policy-loss config (``tau_p`` / ``q`` / ``strategy`` when it has them).

    Returns:
        ``{"token_dump/seconds", "token_dump/records", "token_dump/responses",
        "token_dump/max_prob_diff"}`` (floats) on a step's first mini-batch, else ``{}``.
    """
    from verl.utils import tensordict_utils as tu

    if getattr(getattr(worker, "config", None), "model_type", "language_model") != "language_model":
        return {}  # a critic's TrainingWorker
    if not _tracker.observe(bool(tu.get(data, "update_lr_scheduler", True))):
        return {}
    start = time.perf_counter()
    settings = settings_from_env()
    _check_supported(worker)
    step = _step_number(worker)
    group = _Group(worker.engine.get_data_parallel_group(), _module_device(worker.engine.module))
    tau_p, q, strategy, s2t_in_loss = _loss_settings(cfg)
    method = settings.method or str(getattr(cfg, "loss_mode", "unknown"))

    fields = _host_fields(data, response_mask)
    picked = select_responses(fields["advantage"].tolist(), settings.responses, (step, group.rank))
    n_forward = int(group.max([len(picked)])[0])
    temperature = float(_scalar_setting(data, "temperature", 1.0))
    uids, indices = _uids_and_indices(data, fields["batch"], step, group.rank)
    sampled = []
    for j in range(n_forward):
        row = picked[j] if j < len(picked) else picked[0]  # same forward count on every rank
        resp = _score_row(worker.engine, group.device, fields, row, temperature)
        if j < len(picked):
            resp.uid, resp.response_index, resp.rank = uids[row], indices[row], group.rank
            sampled.append(resp)

    tau_h, tau_h_source, s2t_keep = _entropy_threshold(fields, sampled, picked, group, tau_p, q, strategy)
    silenced_from = "s2t_recomputed" if s2t_in_loss else "update_mask"
    records = []
    decode = _Decoder(getattr(worker.model_config, "tokenizer", None))
    for resp, row in zip(sampled, picked):
        if s2t_in_loss:
            resp.silenced = s2t_keep[row] == 0
        records += build_records(resp, step=step, method=method, tau_p=tau_p, tau_h=tau_h, context=settings.context,
                                 decode=decode, ids=settings.ids,
                                 extra={"tau_h_source": tau_h_source, "silenced_from": silenced_from})
    diff = max([_prob_diff(r) for r in sampled] + [0.0])
    diff = group.max([diff])[0]
    gathered = group.gather_objects(records)
    total = sum(len(r) for r in gathered)
    if group.rank == 0:
        write_step(settings.run_dir, step, [rec for part in gathered for rec in part])
    n_responses = sum(1 for part in gathered for rec in part if rec["kind"] == "response")
    return {METRIC_PREFIX + "seconds": time.perf_counter() - start, METRIC_PREFIX + "records": float(total),
            METRIC_PREFIX + "responses": float(n_responses), METRIC_PREFIX + "max_prob_diff": float(diff)}


def _host_fields(data, response_mask: Optional[torch.Tensor]) -> dict:
    """Padded ``(B, R)`` host copies of the per-token fields, the rows' sequences and response lengths."""
    from .token_selection import ROLLOUT_ENTROPY_FIELD, to_padded

    current = data["response_mask"]
    original = current if response_mask is None else response_mask
    width = int(to_padded(original).shape[1])
    lengths = _response_lengths(data, width)
    mask = _padded(original, width).cpu()
    adv = _padded(data["advantages"], width).float().cpu()
    fields = {
        "batch": len(lengths), "width": width, "lengths": lengths, "mask": mask,
        "folded": _padded(current, width).cpu(), "advantages": adv,
        "old_log_prob": _padded(data["old_log_probs"], width).float().cpu() if "old_log_probs" in data else None,
        "entropy": _padded(data[ROLLOUT_ENTROPY_FIELD], width).float().cpu() if ROLLOUT_ENTROPY_FIELD in data else None,
        "input_ids": list(data["input_ids"].unbind()), "position_ids": list(data["position_ids"].unbind()),
        "responses": _padded(data["responses"], width).cpu() if "responses" in data else None,
    }
    m = mask != 0
    counts = m.sum(-1).clamp(min=1)
    fields["advantage"] = torch.where(m, adv, torch.zeros_like(adv)).double().sum(-1) / counts
    return fields


def _score_row(engine, device, fields: dict, row: int, temperature: float) -> SampledResponse:
    """Forward one row and wrap its response positions' statistics."""
    n = int(fields["lengths"][row])
    seq = fields["input_ids"][row]
    if n < 1 or n >= seq.shape[-1]:
        raise ValueError(f"token dump: row {row} has {n} response tokens in a {seq.shape[-1]}-token sequence")
    response_ids = seq[-n:].cpu()
    if fields["responses"] is not None and not torch.equal(fields["responses"][row, :n], response_ids):
        raise ValueError(f"token dump: row {row}: the tail of input_ids is not the response (unexpected layout)")
    logits = _response_logits(engine, seq, fields["position_ids"][row], n, device)
    stats = {k: v.cpu() for k, v in token_stats(logits, response_ids, temperature).items()}
    del logits
    mask = fields["mask"][row, :n]
    return SampledResponse(
        prompt_ids=seq[:-n].tolist(), response_ids=response_ids.tolist(), stats=stats, mask=mask,
        advantages=fields["advantages"][row, :n], silenced=(mask != 0) & (fields["folded"][row, :n] == 0),
        old_log_prob=None if fields["old_log_prob"] is None else fields["old_log_prob"][row, :n],
        uid="", response_index=0, rank=0, row=row)


def _entropy_threshold(fields: dict, sampled: list, picked: list, group: _Group, tau_p: float, q: float,
                       strategy: str) -> tuple[Optional[float], str, Optional[torch.Tensor]]:
    """``(tau_h, source, keep)``: S2T's threshold (None when undefined) and keep mask ``(B, R)``
    (``mini_batch`` source) or ``(k, R)`` over the sampled rows (``sampled`` source)."""
    from stapo_core import s2t_mask

    if fields["entropy"] is not None and fields["old_log_prob"] is not None:
        source = "mini_batch"
        log_prob, entropy, adv, mask = fields["old_log_prob"], fields["entropy"], fields["advantages"], fields["mask"]
    else:
        source = "sampled"
        width = fields["width"]
        log_prob, entropy, adv, mask = (_stack_padded([_stat(r, name) for r in sampled], width)
                                        for name in ("log_prob", "entropy", "advantages", "mask"))
    dev = group.device
    result = s2t_mask(log_prob.to(dev), entropy.to(dev), adv.to(dev), mask.to(dev), tau_p=tau_p, q=q,
                      strategy=strategy, group=group.s2t_group)
    tau_h = result.stats["tau_h"]
    keep = result.keep.cpu()
    if source == "sampled":  # index by mini-batch row like the mini_batch source
        keep = {row: keep[j] for j, row in enumerate(picked)}
    return (tau_h if math.isfinite(tau_h) else None), source, keep


def _stat(resp: SampledResponse, name: str) -> torch.Tensor:
    """A per-position ``(R,)`` tensor of ``resp``: a :func:`token_stats` entry or a field."""
    return resp.stats[name] if name in resp.stats else getattr(resp, name)


def _stack_padded(rows: list, width: int) -> torch.Tensor:
    """``(len(rows), width)`` float32: the ``(R_i,)`` rows zero-padded on the right."""
    if not rows:
        return torch.zeros(0, width)
    return torch.stack([torch.nn.functional.pad(t.float(), (0, width - t.shape[0])) for t in rows])


def _prob_diff(resp: SampledResponse) -> float:
    """max |p - exp(old_log_prob)| over the response's mask tokens (0 without old log-probs)."""
    if resp.old_log_prob is None:
        return 0.0
    m = resp.mask != 0
    if not bool(m.any()):
        return 0.0
    return float((resp.stats["prob"][m].double() - resp.old_log_prob[m].double().exp()).abs().max())


__all__ = [
    "CHUNK_POSITIONS", "CONTEXT_ENV", "DIR_ENV", "DumpSettings", "IDS_ENV", "METHOD_ENV", "MiniBatchTracker",
    "RESPONSES_ENV", "SampledResponse", "build_records", "dump_mini_batch", "enabled", "select_responses",
    "settings_from_env", "token_stats", "write_step",
]
