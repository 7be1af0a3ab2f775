"""The memory probes (:mod:`stapo_memory.peaks`). Importing this module applies them in this process,
each once its verl module is imported (a calibration run names it in ``VERL_USE_EXTERNAL_MODULES``;
docs/memory.md, "Calibrating on a GPU"); ``python -m stapo_memory.probes [check [VERL_SOURCE]]`` prints
the table (docs/probes.md) or checks it against a verl's source, applying nothing."""

from __future__ import annotations

import sys

from verl_patches.registry import Patch, apply_on_import, main, render_table

_ENGINE_WORKERS = "verl.workers.engine_workers"

#: the probes, in the order they are applied
PROBES: tuple[Patch, ...] = (
    Patch(
        name="probe_infer",
        target=f"{_ENGINE_WORKERS}:TrainingWorker.infer_batch",
        wrapper="stapo_memory.peaks:wrap_infer_batch",
        changes="on CUDA, resets PyTorch's peak memory before a forward pass (log-prob; reference on a "
                "forward-only engine; the recipe's current-policy and update-effect forwards inside the update) "
                "and logs on rank 0 its allocated and reserved peaks, the device-wide figure, the memory outside "
                "PyTorch's allocator and its largest micro-batch's tokens ('[stapo] memory peak: ...')",
        why="verl's perf/max_memory_* never reset, so they give one peak for all passes; the memory model "
            "is calibrated term by term (python -m stapo_memory.calibration)",
        relies_on="compute_log_prob and compute_ref_log_prob calling TrainingWorker.infer_batch once per pass, "
                  "the engine's forward_step once per micro-batch",
        drop_when="verl logs a peak per pass",
        anchors=("def infer_batch(self, data: TensorDict)",
                 "output = self.ref.infer_batch(data=data)", "output = self.actor.infer_batch(data)",
                 "verl/workers/engine/fsdp/transformer_impl.py: self.forward_step(micro_batch, loss_function="),
    ),
    Patch(
        name="probe_update",
        target=f"{_ENGINE_WORKERS}:TrainingWorker.train_mini_batch",
        wrapper="stapo_memory.peaks:wrap_train_mini_batch",
        changes="the same for the update (a forward inside it is logged as its own pass; the update's line "
                "covers both)",
        why="the update's peak, for the memory model's calibration",
        relies_on="update_actor calling TrainingWorker.train_mini_batch once per step",
        drop_when="verl logs a peak per pass",
        anchors=("def train_mini_batch(self, data: TensorDict)",
                 "output = self.actor.train_mini_batch(data=data)"),
    ),
    Patch(
        name="probe_rollout",
        target=f"{_ENGINE_WORKERS}:ActorRolloutRefWorker.update_weights",
        wrapper="stapo_memory.peaks:wrap_update_weights",
        changes="on CUDA, logs on rank 0 the device-wide memory when the weight sync returns, vLLM awake with "
                "its weights and KV cache ('[stapo] memory peak: pass=rollout ...')",
        why="vLLM's share and the fixed overhead are only visible device-wide; the rollout is calibrated from it",
        relies_on="the colocated trainer calling ActorRolloutRefWorker.update_weights before each rollout, "
                  "which resumes vLLM's weights and KV cache",
        drop_when="verl logs the device-wide memory of the rollout",
        anchors=('async def update_weights(self, global_steps: int = None, mode: str = "auto")',
                 "verl/checkpoint_engine/base.py: ray.get(self.actor_wg.update_weights(global_steps=global_steps, "
                 "mode=self.backend))"),
    ),
)


def table() -> str:
    """The probes' table as a Markdown document (what ``python -m stapo_memory.probes`` prints)."""
    return render_table(PROBES, "The memory probes of a calibration run", "python -m stapo_memory.probes",
                        "stapo_memory/probes.py", [
        "These patches measure and change nothing a run computes. Only a calibration run has them: "
        "`VERL_USE_EXTERNAL_MODULES=verl_patches.activate,stapo_memory.probes` makes every verl process import "
        "`stapo_memory.probes`, which applies each probe once its verl module is imported. How to launch and "
        "read a calibration run: [memory.md](memory.md), \"Calibrating on a GPU\".",
    ])


if __name__ == "__main__":  # python -m stapo_memory.probes [check [VERL_SOURCE]]: nothing applied
    sys.exit(main(PROBES, table, "python -m stapo_memory.probes", sys.argv[1:]))
else:  # imported (VERL_USE_EXTERNAL_MODULES): the probes, in this process
    for probe in PROBES:
        apply_on_import(probe)
