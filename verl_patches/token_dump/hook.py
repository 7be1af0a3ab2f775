"""The token dump's actor side: the candidate tokens of a few sampled responses of each step's first
mini-batch, scored under the policy about to be updated, and what the update did to them.

Only the actor holds the logits when S2T decides, and a step's first mini-batch is still the rollout
policy's. Each data-parallel rank scores its sampled responses (:func:`score_mini_batch`, before the
update) and takes each token's ``dlogp`` from the update's probe; rank 0 writes every rank's records
to ``<dir>/s2t_tokens/step_XXXXXX.jsonl`` (:func:`finish_mini_batch`). Off by default; the records:
docs/inspect.md.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Optional

import torch
from verl.utils import tensordict_utils as tu

from stapo_core import s2t_mask
from stapo_core.distributed import all_reduce_max, gather_objects, group_rank
from stapo_core.rules import S2T
from stapo_core.token_records import write_step

from ..mini_batch_view import HostFields, MiniBatchPosition, MiniBatchView
from ..policy_loss_config import TokenSelectionLossConfig
from ..token_selection import as_s2t
from ..update_effect import Probe
from .scoring import SampledResponse, build_records, select_responses, token_stats
from .settings import enabled, settings_from_env

METRIC_PREFIX = "token_dump/"


def _scalar_setting(data, key: str, default):
    value = tu.get(data, key, default)
    if isinstance(value, torch.Tensor):
        if value.numel() == 0:
            return default
        if not bool((value == value.reshape(-1)[0]).all()):
            raise ValueError(f"token dump: per-row {key} values differ; the dump supports one value per mini-batch")
        return value.reshape(-1)[0].item()
    return default if value is None else value


def _autocast(engine, device: torch.device):
    """verl's FSDP engine's forward context: autocast to its compute dtype unless float32."""
    dtype = getattr(engine, "_autocast_dtype", torch.float32)
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def _response_logits(engine, input_ids: torch.Tensor, position_ids: torch.Tensor, n_resp: int,
                     device: torch.device) -> torch.Tensor:
    """``(n_resp, V)`` logits predicting the last ``n_resp`` tokens of one unpadded sequence: a batch
    of one without padding (``attention_mask=None``, as verl's remove-padding path), under the
    engine's autocast."""
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


def s2t_settings(cfg) -> TokenSelectionLossConfig:
    """The S2T settings the dump records for ``cfg``: its ``tau_p``, ``q`` and thresholded strategy,
    else the paper's (``low_entropy``)."""
    if not isinstance(cfg, TokenSelectionLossConfig):
        return TokenSelectionLossConfig(token_selection=S2T.name)
    strategy = cfg.strategy if cfg.applies_s2t and cfg.strategy in ("low_entropy", "high_entropy") else "low_entropy"
    return as_s2t(cfg, strategy=strategy)


def _uids_and_indices(data, batch: int, step: int, rank: int) -> tuple[list, list]:
    """Group uid per row (verl's ``uid`` field, else ``s<step>r<rank>i<row>``) and each row's ordinal
    among the rows of this rank with the same uid."""
    uids = tu.get(data, "uid", None)
    uids = [str(u) for u in uids] if uids is not None and len(uids) == batch else [
        f"s{step}r{rank}i{i}" for i in range(batch)]
    seen: dict = {}
    indices = []
    for u in uids:
        indices.append(seen.get(u, 0))
        seen[u] = indices[-1] + 1
    return uids, indices


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


def _step_number(worker, position: MiniBatchPosition) -> int:
    """The 1-based training step: the actor's lr-scheduler count + 1 (one scheduler step per training
    step, restored with checkpoints), else the worker's own count."""
    scheduler = getattr(getattr(worker, "engine", None), "lr_scheduler", None)
    last = getattr(scheduler, "last_epoch", None)
    return int(last) + 1 if isinstance(last, int) and last >= 0 else position.step


def _check_supported(worker) -> None:
    engine = worker.engine
    if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
        raise ValueError("token dump: ulysses_sequence_parallel_size > 1 is not supported (the dump forwards "
                         "whole sequences); turn recipe.token_dump.dir off or sequence parallelism off")
    if not hasattr(engine, "module"):
        raise ValueError(f"token dump: engine {type(engine).__name__} has no module; only the FSDP engine is supported")


def dumps(worker, position: MiniBatchPosition) -> bool:
    """The dump scores this mini-batch: it is on, the worker is the actor, and the mini-batch is its
    step's first."""
    actor = getattr(getattr(worker, "config", None), "model_type", "language_model") == "language_model"
    return enabled() and actor and position.first


@dataclass(frozen=True)
class DumpRows:
    """What the dump reads of one rank's mini-batch, row by row: the view's host copy, and each row's
    sequence (``input_ids``, ``position_ids``; ``responses``, None when absent) as verl holds it."""

    host: HostFields
    input_ids: list
    position_ids: list
    responses: Optional[list]


@dataclass
class PendingDump:
    """A step's dump between :func:`score_mini_batch` and :func:`finish_mini_batch`: this rank's picked
    rows and their scored responses, the records' settings and thresholds."""

    settings: object
    step: int
    method: str
    group: object
    device: torch.device
    picked: list
    sampled: list
    tau_p: float
    tau_h: Optional[float]
    extra: dict
    seconds: float


def score_mini_batch(worker, view: MiniBatchView) -> PendingDump:
    """Phase 1, before verl's update, on every data-parallel rank: pick a few responses of the
    mini-batch (seeded by step and rank) and score them under the policy about to be updated, one
    no-grad forward each (every rank the same number: a rank with fewer repeats its first).

    ``tau_h``: S2T's threshold with the dump's settings (:func:`s2t_settings`) on the mini-batch's
    rollout statistics (``tau_h_source`` ``mini_batch``), else over every rank's sampled responses
    (``sampled``). ``silenced``: where the update's folded mask dropped the token (``update_mask``), or
    where S2T recomputed here silences it (``s2t_recomputed``, approximate: the loss pools per
    micro-batch).
    """
    start = time.perf_counter()
    settings = settings_from_env()
    _check_supported(worker)
    step = _step_number(worker, view.position)
    rank = group_rank(view.group)
    cfg, s2t = view.cfg, view.dump_s2t
    s2t_in_loss = isinstance(cfg, TokenSelectionLossConfig) and cfg.applies_s2t and cfg.selects_in_loss
    method = settings.method or str(getattr(cfg, "loss_mode", "unknown"))
    data, host = view.data, view.host
    rows = DumpRows(host, list(data["input_ids"].unbind()), list(data["position_ids"].unbind()),
                    list(data["responses"].unbind()) if "responses" in data else None)
    inside = host.mask != 0
    advantage = torch.where(inside, host.advantages, 0.0).double().sum(-1) / inside.sum(-1).clamp(min=1)
    picked = select_responses(advantage.tolist(), settings.responses, (step, rank))
    n_forward = int(all_reduce_max(torch.tensor([len(picked)], device=view.device), view.group))
    temperature = float(_scalar_setting(data, "temperature", 1.0))
    uids, indices = _uids_and_indices(data, len(rows.input_ids), step, rank)
    sampled = []
    for j in range(n_forward):
        row = picked[j] if j < len(picked) else picked[0]  # same forward count on every rank
        resp = _score_row(worker.engine, view.device, rows, row, temperature)
        if j < len(picked):
            resp.uid, resp.response_index, resp.rank = uids[row], indices[row], rank
            sampled.append(resp)

    sets = view.selection.dump
    if sets is not None:  # the mini-batch's rollout statistics
        tau_h, tau_h_source, silenced = sets.tau_h, "mini_batch", {row: sets.silenced[row].cpu() for row in picked}
    else:
        tau_h, tau_h_source, silenced = _sampled_threshold(sampled, picked, view, s2t)
    if s2t_in_loss:
        for resp, row in zip(sampled, picked):
            resp.silenced = silenced[row]
    extra = {"tau_h_source": tau_h_source, "silenced_from": "s2t_recomputed" if s2t_in_loss else "update_mask"}
    return PendingDump(settings, step, method, view.group, view.device, picked, sampled, s2t.tau_p, tau_h, extra,
                       time.perf_counter() - start)


def finish_mini_batch(worker, pending: PendingDump, probe: Optional[Probe]) -> dict:
    """Phase 2, after verl's update of the same mini-batch: each token's ``dlogp`` from ``probe`` (the
    update's, holding every picked row), then the records, written by rank 0 for every rank. Metrics:
    ``seconds`` (both phases and the probe, this rank), ``records`` and ``responses`` (all ranks),
    ``max_prob_diff`` (the largest gap between the dump's p and the rollout's, all ranks)."""
    start = time.perf_counter()
    if probe is not None:
        for resp in pending.sampled:
            resp.dlogp = probe.dlogp[probe.rows.index(resp.row), : len(resp.response_ids)]
    records = []
    decode = _Decoder(getattr(worker.model_config, "tokenizer", None))
    for resp in pending.sampled:
        records += build_records(resp, step=pending.step, method=pending.method, tau_p=pending.tau_p,
                                 tau_h=pending.tau_h, context=pending.settings.context, decode=decode,
                                 ids=pending.settings.ids, extra=pending.extra)
    diff = max([_prob_diff(r) for r in pending.sampled] + [0.0])
    diff = float(all_reduce_max(torch.tensor([diff], dtype=torch.float64, device=pending.device), pending.group))
    gathered = gather_objects(records, pending.group)
    total = sum(len(r) for r in gathered)
    if group_rank(pending.group) == 0:
        write_step(pending.settings.run_dir, pending.step, [rec for part in gathered for rec in part])
    n_responses = sum(1 for part in gathered for rec in part if rec["kind"] == "response")
    seconds = pending.seconds + (probe.seconds if probe is not None else 0.0) + time.perf_counter() - start
    return {METRIC_PREFIX + "seconds": seconds, METRIC_PREFIX + "records": float(total),
            METRIC_PREFIX + "responses": float(n_responses), METRIC_PREFIX + "max_prob_diff": diff}


def _score_row(engine, device, rows: DumpRows, row: int, temperature: float) -> SampledResponse:
    host = rows.host
    n = int(host.lengths[row])
    seq = rows.input_ids[row]
    if n < 1 or n >= seq.shape[-1]:
        raise ValueError(f"token dump: row {row} has {n} response tokens in a {seq.shape[-1]}-token sequence")
    response_ids = seq[-n:].cpu()
    if rows.responses is not None and not torch.equal(rows.responses[row][:n].cpu(), response_ids):
        raise ValueError(f"token dump: row {row}: the tail of input_ids is not the response (unexpected layout)")
    logits = _response_logits(engine, seq, rows.position_ids[row], n, device)
    stats = {k: v.cpu() for k, v in token_stats(logits, response_ids, temperature).items()}
    del logits
    mask = host.mask[row, :n]
    return SampledResponse(
        prompt_ids=seq[:-n].tolist(), response_ids=response_ids.tolist(), stats=stats, mask=mask,
        advantages=host.advantages[row, :n], silenced=(mask != 0) & (host.folded[row, :n] == 0),
        old_log_prob=None if host.old_log_prob is None else host.old_log_prob[row, :n],
        uid="", response_index=0, rank=0, row=row)


def _sampled_threshold(sampled: list, picked: list, view: MiniBatchView,
                       s2t: TokenSelectionLossConfig) -> tuple[Optional[float], str, dict]:
    """``(tau_h, "sampled", silenced)`` without rollout statistics: S2T over the sampled responses of
    every rank with the dump's own p and H (``tau_h`` None when undefined; ``silenced``: each picked
    row's silenced tokens)."""
    width = view.mask.shape[1]
    log_prob, entropy, adv, mask = (_stack_padded([_stat(r, name) for r in sampled], width).to(view.device)
                                    for name in ("log_prob", "entropy", "advantages", "mask"))
    result = s2t_mask(log_prob, entropy, adv, mask, tau_p=s2t.tau_p, q=s2t.q, strategy=s2t.strategy,
                      group=view.group)
    tau_h, silenced = result.stats["tau_h"], (mask != 0) & (result.keep == 0)
    return (tau_h if math.isfinite(tau_h) else None), "sampled", {row: silenced[j].cpu() for j, row in enumerate(picked)}


def _stat(resp: SampledResponse, name: str) -> torch.Tensor:
    """``(R,)``: a :func:`token_stats` entry or a field of ``resp``."""
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
