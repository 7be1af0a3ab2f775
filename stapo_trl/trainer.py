"""``STAPOTrainer``: TRL's ``GRPOTrainer`` with S2T's keep mask in its loss (docs/trl.md).

Only TRL's extension points are used; TRL's loss code runs unchanged. At the first micro-batch of
each optimizer step one no-grad forward of the policy being updated (over the positive-advantage
completions, or every one with ``current_forward="full"``) gives ``log p`` and the entropy, and
:func:`stapo_trl.s2t_window` turns them into keep masks ``M``. A step that silences nothing enters
TRL's ``_compute_loss`` untouched (TRL's loss bit for bit); otherwise ``M`` is multiplied into its
``tool_mask`` and ``num_items_in_batch`` scaled by the step's kept fraction
(:func:`stapo_trl.selection.kept_items`). docs/trl.md gives the resulting loss per ``loss_type``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from stapo_core.distributed import all_reduce_sum

from .config import STAPOConfig
from .selection import kept_items, positive_advantage_rows, random_strategy_seed, s2t_window

#: the statistics logged each optimizer step, as ``s2t/<name>`` (the verl recipe's ``actor/s2t/<name>``)
S2T_METRICS = ("tokens", "candidates", "silenced", "silenced_frac", "tau_h", "entropy_silenced_mean",
               "entropy_kept_candidates_mean", "current_forward_tokens_frac", "current_forward_s")

#: batch keys TRL passes to the model besides the token ids (multimodal models)
_MODEL_INPUT_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                     "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens TRL's loss uses: the completion mask times the tool mask when there is one."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


def _has_model_inputs(batch: dict) -> bool:
    """True for a multimodal batch: its image tensors are not indexed by completion."""
    return any(batch.get(key) is not None for key in _MODEL_INPUT_KEYS)


class STAPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss silences S2T's spurious tokens; ``args`` must be a :class:`STAPOConfig`.

    Logs ``s2t/<name>`` for each name of :data:`S2T_METRICS` once per optimizer step (``tau_h``
    and the two entropy means only when defined): ``s2t_mask``'s statistics of the step, the share
    of the step's prompt + completion tokens the statistics forward covered (every process) and
    its wall time on this process.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, STAPOConfig):
            raise TypeError(f"STAPOTrainer: args must be a STAPOConfig, got {type(self.args).__name__}")
        #: by buffer slot: keep mask, the step's loss tokens and kept tokens (every process)
        self._s2t_keeps: dict[int, tuple[torch.Tensor, int, int]] = {}
        self._s2t_keeps_step = None  # the optimizer step (state.global_step) they belong to
        self._s2t_generator = None
        if self.args.strategy == "random":  # each process draws for its own candidates
            self._s2t_generator = torch.Generator(device=self.accelerator.device)
            self._s2t_generator.manual_seed(random_strategy_seed(self.args.seed, self.accelerator.process_index))

    # ------------------------------------------------------------------------------------------
    # statistics and masks
    # ------------------------------------------------------------------------------------------

    def _s2t_group(self):
        """The processes ``tau_h`` is pooled over: all of them (None for one process)."""
        return dist.group.WORLD if self.accelerator.num_processes > 1 else None

    def _s2t_rows(self, batch: dict) -> torch.Tensor:
        """bool ``(batch,)``: the completions whose statistics S2T needs."""
        mask = loss_mask(batch)
        if self.args.tau_p == 0:  # p < 0 never holds: no candidate anywhere
            return torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
        if self.args.current_forward == "full" or _has_model_inputs(batch):
            return torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
        return positive_advantage_rows(batch["advantages"], mask)

    @torch.no_grad()
    def _s2t_statistics(self, model, batches: list, rows: list, mode: str) -> tuple[list, list]:
        """``(log_probs, entropies)``: per micro-batch, float32 ``(batch_k, completion_len)``
        ``log p`` and entropy of each completion token under ``model`` as it is now, from TRL's
        fused forward; 0 on the rows of ``rows`` not selected (``log p = 0`` is never a candidate).

        The selected rows of micro-batches of one width are forwarded together, in chunks of the
        per-device batch size (TRL's chunk for its own no-grad forwards); a multimodal micro-batch
        is forwarded whole, with its image inputs."""
        log_probs = [torch.zeros(b["completion_mask"].shape, dtype=torch.float32, device=b["completion_mask"].device)
                     for b in batches]
        entropies = [lp.clone() for lp in log_probs]
        chunk = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        groups: dict[tuple, list] = {}
        for k, (batch, selected) in enumerate(zip(batches, rows)):
            index = selected.nonzero().flatten()
            if index.numel():
                width = (batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1])
                groups.setdefault(width if not _has_model_inputs(batch) else ("whole", k), []).append((k, index))
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            for members in groups.values():
                parts = [(batches[k], index) for k, index in members]
                input_ids = torch.cat([torch.cat([b["prompt_ids"], b["completion_ids"]], 1)[i] for b, i in parts])
                attention = torch.cat([torch.cat([b["prompt_mask"], b["completion_mask"]], 1)[i] for b, i in parts])
                extra = {key: parts[0][0].get(key) for key in _MODEL_INPUT_KEYS} if len(parts) == 1 else {}
                lp, ent, _ = self._get_per_token_logps_and_entropies(
                    model, input_ids, attention, parts[0][0]["completion_ids"].shape[1], batch_size=chunk,
                    compute_entropy=True, **extra,
                )
                for (k, index), lp_k, ent_k in zip(members, lp.split([len(i) for _, i in parts]),
                                                    ent.split([len(i) for _, i in parts])):
                    log_probs[k][index] = lp_k.float()
                    entropies[k][index] = ent_k.float()
        return log_probs, entropies

    def _s2t_forward_share(self, batches: list, rows: list) -> float:
        """Prompt + completion tokens of the selected completions over those of all of ``batches``,
        every process (the verl recipe's ``current_forward_tokens_frac``)."""
        counts = torch.zeros(2, dtype=torch.float64, device=batches[0]["completion_mask"].device)
        for batch, selected in zip(batches, rows):
            tokens = batch["prompt_mask"].sum(-1) + batch["completion_mask"].sum(-1)
            counts += torch.stack([tokens[selected].sum(), tokens.sum()]).double()
        forwarded, total = all_reduce_sum(counts, self._s2t_group()).tolist()
        return forwarded / max(total, 1.0)

    def _s2t_select(self, model, batches: list, mode: str) -> list:
        """Per micro-batch of ``batches`` (one optimizer step): ``(keep mask, the step's loss
        tokens, its kept tokens)``, counts over every process; logs the step's S2T statistics."""
        start = time.perf_counter()
        rows = [self._s2t_rows(batch) for batch in batches]
        log_probs, entropies = self._s2t_statistics(model, batches, rows, mode)
        elapsed = time.perf_counter() - start
        keeps, stats = s2t_window(
            log_probs,
            entropies,
            [batch["advantages"] for batch in batches],
            [loss_mask(batch) for batch in batches],
            tau_p=self.args.tau_p,
            q=self.args.q,
            strategy=self.args.strategy,
            group=self._s2t_group(),
            generator=self._s2t_generator,
        )
        stats = dict(stats, current_forward_tokens_frac=self._s2t_forward_share(batches, rows),
                     current_forward_s=elapsed)
        for name in S2T_METRICS:
            value = float(stats[name])
            if math.isfinite(value):
                self._metrics[mode][f"s2t/{name}"].append(value)
        tokens, kept = stats["tokens"], stats["tokens"] - stats["silenced"]
        return [(keep, tokens, kept) for keep in keeps]

    def _s2t_keep(self, model, inputs: dict, mode: str) -> tuple[torch.Tensor, int, int]:
        """This micro-batch's keep mask and its step's loss and kept tokens (every process)."""
        if mode != "train":  # evaluation: the batch alone is the step
            return self._s2t_select(model, [inputs], mode)[0]
        slot = self._step % self.args.steps_per_generation
        if self._s2t_keeps_step != self.state.global_step:  # first micro-batch of an optimizer step
            window = self._buffered_inputs[slot: slot + self.current_gradient_accumulation_steps]
            self._s2t_keeps = dict(enumerate(self._s2t_select(model, window, mode), start=slot))
            self._s2t_keeps_step = self.state.global_step
        if slot not in self._s2t_keeps:
            raise RuntimeError(
                f"STAPOTrainer: no S2T mask for micro-batch {self._step} (buffer slot {slot}): the optimizer step's "
                "micro-batches were not the ones TRL buffered at its first micro-batch"
            )
        return self._s2t_keeps[slot]

    # ------------------------------------------------------------------------------------------
    # the loss
    # ------------------------------------------------------------------------------------------

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        keep, tokens, kept = self._s2t_keep(model, inputs, mode)
        completion_mask = inputs["completion_mask"]
        if keep.shape != completion_mask.shape:
            raise RuntimeError(
                f"STAPOTrainer: S2T mask of shape {tuple(keep.shape)} for a micro-batch of shape "
                f"{tuple(completion_mask.shape)}"
            )
        if kept == tokens:  # the step silences nothing: TRL's loss as it is
            return super()._compute_loss(model, inputs)
        inputs = dict(inputs)
        keep = keep.to(completion_mask.dtype)  # already 0 outside the completion and tool masks
        inputs["tool_mask"] = keep if "tool_mask" not in inputs else inputs["tool_mask"] * keep
        inputs["num_items_in_batch"] = kept_items(inputs["num_items_in_batch"], kept, tokens)
        return super()._compute_loss(model, inputs)


__all__ = ["S2T_METRICS", "STAPOTrainer", "loss_mask"]
