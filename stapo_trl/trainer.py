"""``STAPOTrainer``: TRL's ``GRPOTrainer`` with S2T's keep mask in its loss (docs/trl.md).

Only TRL's extension points are used; TRL's loss code runs unchanged:

* at the first micro-batch of each optimizer step, one no-grad forward of the policy being updated
  over the step's micro-batches (TRL buffers them from one generation) gives ``log p`` and the
  entropy of every completion token; :func:`stapo_trl.s2t_window` turns them into keep masks, the
  entropy quantile pooled over the step's micro-batches and every process;
* each micro-batch then enters TRL's ``_compute_loss`` with the keep mask multiplied into its
  ``tool_mask``, the mask TRL applies to every loss term, aggregation and metric (TRL's way to leave
  tokens out of the loss), and, for the losses normalised by the batch's token count (``dapo``,
  ``cispo``, ``vespo``), ``num_items_in_batch`` counting the kept tokens: the loss is averaged over
  the kept tokens as each of TRL's aggregations averages.

With a single update per generation (TRL's default) the policy being updated is the one that
sampled, so the statistics are the sampling policy's; with several optimizer steps per generation
(``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``) each step's
statistics come from the current policy, as the paper's Algorithm 1.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from trl import GRPOTrainer

from .config import STAPOConfig
from .selection import s2t_window

#: the statistics logged each optimizer step, as ``s2t/<name>`` (the verl recipe's ``actor/s2t/<name>``)
S2T_METRICS = ("tokens", "candidates", "silenced", "silenced_frac", "tau_h", "entropy_silenced_mean",
               "entropy_kept_candidates_mean")

#: batch keys TRL passes to the model besides the token ids (multimodal models)
_MODEL_INPUT_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                     "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def loss_mask(inputs: dict) -> torch.Tensor:
    """The tokens TRL's loss uses: the completion mask times the tool mask when there is one."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


class STAPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss silences S2T's spurious tokens; ``args`` must be a :class:`STAPOConfig`.

    Logs ``s2t/tokens``, ``s2t/candidates``, ``s2t/silenced``, ``s2t/silenced_frac``, ``s2t/tau_h``,
    ``s2t/entropy_silenced_mean`` and ``s2t/entropy_kept_candidates_mean`` once per optimizer step
    (the last three only when defined).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, STAPOConfig):
            raise TypeError(f"STAPOTrainer: args must be a STAPOConfig, got {type(self.args).__name__}")
        #: keep masks (and the step's kept-token count) of the current optimizer step, by buffer slot
        self._s2t_keeps: dict[int, tuple[torch.Tensor, int]] = {}
        self._s2t_keeps_step = None  # the optimizer step (state.global_step) they belong to
        self._s2t_generator = None
        if self.args.strategy == "random":  # each process draws for its own tokens, seeded apart
            self._s2t_generator = torch.Generator(device=self.accelerator.device)
            self._s2t_generator.manual_seed(self.args.seed + self.accelerator.process_index)

    # ------------------------------------------------------------------------------------------
    # statistics and masks
    # ------------------------------------------------------------------------------------------

    def _s2t_group(self):
        """The processes ``tau_h`` is pooled over: all of them (None for one process)."""
        return dist.group.WORLD if self.accelerator.num_processes > 1 else None

    @torch.no_grad()
    def _s2t_statistics(self, model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p, entropy)`` of each completion token of ``inputs`` under ``model`` as it is now,
        from the same forward TRL's loss uses."""
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        log_probs, entropies, _ = self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            inputs["completion_ids"].size(1),
            compute_entropy=True,
            **{key: inputs.get(key) for key in _MODEL_INPUT_KEYS},
        )
        return log_probs, entropies

    def _s2t_select(self, model, batches: list, mode: str) -> list:
        """Keep masks of ``batches`` (the micro-batches of one optimizer step) and the step's
        kept-token count over every process; logs the step's S2T statistics."""
        statistics = [self._s2t_statistics(model, batch) for batch in batches]
        keeps, stats = s2t_window(
            [lp for lp, _ in statistics],
            [ent for _, ent in statistics],
            [batch["advantages"] for batch in batches],
            [loss_mask(batch) for batch in batches],
            tau_p=self.args.tau_p,
            q=self.args.q,
            strategy=self.args.strategy,
            group=self._s2t_group(),
            generator=self._s2t_generator,
        )
        for name in S2T_METRICS:
            value = float(stats[name])
            if math.isfinite(value):
                self._metrics[mode][f"s2t/{name}"].append(value)
        kept = stats["tokens"] - stats["silenced"]
        return [(keep, kept) for keep in keeps]

    def _s2t_keep(self, model, inputs: dict, mode: str) -> tuple[torch.Tensor, int]:
        """This micro-batch's keep mask and its step's kept-token count (all processes)."""
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
        keep, kept = self._s2t_keep(model, inputs, mode)
        completion_mask = inputs["completion_mask"]
        if keep.shape != completion_mask.shape:
            raise RuntimeError(
                f"STAPOTrainer: S2T mask of shape {tuple(keep.shape)} for a micro-batch of shape "
                f"{tuple(completion_mask.shape)}"
            )
        inputs = dict(inputs)
        keep = keep.to(completion_mask.dtype)  # already 0 outside the completion and tool masks
        inputs["tool_mask"] = keep if "tool_mask" not in inputs else inputs["tool_mask"] * keep
        # TRL's dapo/cispo/vespo normalise by num_items_in_batch / processes (x GA / SPG in training):
        # make that the kept tokens of this optimizer step over the processes
        count = kept * self.args.steps_per_generation / self.current_gradient_accumulation_steps if mode == "train" \
            else kept
        original = inputs["num_items_in_batch"]
        inputs["num_items_in_batch"] = (
            torch.tensor(int(count), dtype=original.dtype, device=original.device) if float(count).is_integer()
            else torch.tensor(count, dtype=torch.float32, device=original.device)
        )
        return super()._compute_loss(model, inputs)


__all__ = ["S2T_METRICS", "STAPOTrainer", "loss_mask"]
