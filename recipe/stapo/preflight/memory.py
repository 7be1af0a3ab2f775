"""GPU memory: the memory model's estimate per pass (:mod:`recipe.stapo.memory.model`), with its
margin, against ``recipe.gpu_mem_gb`` (``GPU_MEM_GB``: GiB as CUDA reports them, default 79.1 for an
80 GB card)."""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig

from recipe.stapo.memory import model as memory_model

from .problem import ACTOR, ROLLOUT, Problem, pick


def model_shape(config: DictConfig, notes: list[str]) -> Optional[memory_model.ModelShape]:
    """The model's shape from its config.json, or the built-in shape of a paper model the launching
    machine cannot read (None, with a note, when neither exists)."""
    path = str(pick(config, "actor_rollout_ref.model.hf_config_path", "") or pick(config, "actor_rollout_ref.model.path", ""))
    try:
        return memory_model.load_shape(path)
    except ValueError:
        shape = memory_model.builtin_shape(path)
        if shape is None:
            notes.append(f"GPU memory not estimated: no readable config.json in {path} and no built-in shape for it")
        return shape


def check_memory(config: DictConfig, found: list[Problem], notes: list[str]) -> Optional[str]:
    """The memory table for the target GPU; a problem per pass that does not fit (``recipe.memory_check``:
    ``refuse``; ``warn`` makes them notes, ``off`` skips the estimate)."""
    mode = pick(config, "recipe.memory_check", "refuse")
    if mode == "off":
        notes.append("GPU memory not checked (recipe.memory_check=off)")
        return None
    if str(pick(config, "trainer.device", "cuda")) == "cpu" or pick(config, f"{ROLLOUT}.name") not in ("vllm", "sglang"):
        notes.append("GPU memory not estimated: the CPU path (trainer.device=cpu) or a rollout other than vLLM/SGLang")
        return None
    shape = model_shape(config, notes)
    if shape is None:
        return None
    gpu = float(pick(config, "recipe.gpu_mem_gb")) * memory_model.GIB
    try:
        settings = memory_model.settings_from_config(config)
    except ValueError as e:  # the policy-loss block, refused by check_names
        notes.append(f"GPU memory not estimated: {e}")
        return None
    estimate = memory_model.estimate(shape, settings, gpu)
    longest = int(pick(config, "data.max_prompt_length")) + int(pick(config, "data.max_response_length"))
    sp = int(pick(config, f"{ACTOR}.ulysses_sequence_parallel_size", 1))
    gpus_per_node = int(pick(config, "trainer.n_gpus_per_node", 8))
    accept_tight = pick(config, "recipe.memory_accept_tight", False)
    if not isinstance(accept_tight, bool):
        found.append(Problem("recipe.memory_accept_tight", "must be true or false",
                             "set recipe.memory_accept_tight=true to run a TIGHT pass, else leave it false", accept_tight))
        accept_tight = False
    passes = {p.name: p for p in estimate.passes}
    for name, setting, problem, fix in memory_model.problems(estimate, gpu, longest, sp, gpus_per_node):
        tight = memory_model.verdict(passes[name], gpu) == "TIGHT"
        if mode == "warn" or (tight and accept_tight):
            flag = "recipe.memory_check=warn" if mode == "warn" else "recipe.memory_accept_tight=true"
            notes.append(f"GPU memory ({flag}): pass '{name}' {problem}; {fix}")
        else:
            found.append(Problem(f"GPU memory, pass '{name}' ({setting})", problem,
                                 f"{fix}; or set GPU_MEM_GB to your GPU's memory as CUDA reports it"
                                 + (", or recipe.memory_accept_tight=true to run inside the margin" if tight else "")
                                 + ", or recipe.memory_check=warn if you know the estimate is wrong for your setup "
                                 "(docs/memory.md)"))
    return memory_model.table(estimate, gpu)
