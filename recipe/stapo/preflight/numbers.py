"""Numbers and how they relate: sizes, group size, divisibility, token budgets, the memory check's settings."""

from __future__ import annotations

import math
import os
from typing import Optional

from omegaconf import DictConfig

from .problem import ACTOR, REF, ROLLOUT, Problem, is_int, pick

#: advantage estimators that normalise rewards within each prompt's group of rollout.n responses
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg",
                    "reinforce_plus_plus_baseline", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo")
MEMORY_CHECK_MODES = ("refuse", "warn", "off")
#: the most memory one accelerator has (GiB): more is a unit mistake (MiB, bytes)
MAX_GPU_MEM_GB = 288.0


def check_numbers(config: DictConfig, found: list[Problem]) -> bool:
    """Positive integers, group size, divisibility, token budgets; True when every number is usable."""
    before = len(found)

    def get(key: str, what: str, hint: str = "") -> Optional[int]:
        value = pick(config, key)
        if is_int(value) and value >= 1:
            return value
        found.append(Problem(key, f"{what} must be a whole number >= 1", f"set {key} {hint}".rstrip(), value))
        return None

    nnodes = get("trainer.nnodes", "the number of nodes", "(NNODES in the run scripts; the paper's 64 GPUs: 8)")
    gpus = get("trainer.n_gpus_per_node", "the GPUs per node", "(GPUS_PER_NODE in the run scripts, e.g. 8)")
    rollout_n = get(f"{ROLLOUT}.n", "the responses per prompt", "(the paper: 8)")
    batch = get("data.train_batch_size", "the prompts per step", "(the paper: 256)")
    mini = get(f"{ACTOR}.ppo_mini_batch_size", "the prompts per update", "(the paper: 64)")
    prompt = get("data.max_prompt_length", "the prompt length", "(the paper: 1024)")
    response = get("data.max_response_length", "the response length", "(the paper: 15360)")
    sp = get(f"{ACTOR}.ulysses_sequence_parallel_size", "the sequence parallel size", "(1: none)")
    tp = get(f"{ROLLOUT}.tensor_model_parallel_size", "vLLM's tensor parallel size")

    estimator = str(pick(config, "algorithm.adv_estimator", "grpo"))
    if rollout_n is not None and rollout_n < 2 and estimator in GROUP_ESTIMATORS:
        found.append(Problem(
            f"{ROLLOUT}.n", f"algorithm.adv_estimator={estimator} normalises each reward within its "
            "prompt's group of rollout.n responses, and a group of one leaves the raw +-1 reward as the advantage "
            "(REINFORCE without a baseline; S2T's candidates become every rare token of every correct response)",
            f"set {ROLLOUT}.n >= 2 (the paper: 8)", rollout_n))

    world = nnodes * gpus if nnodes and gpus else None
    if world and sp and world % sp:
        found.append(Problem(f"{ACTOR}.ulysses_sequence_parallel_size", f"does not divide the {world} GPUs",
                             "choose a divisor of the GPU count", sp))
    if world and tp:
        infer = tp * math.prod(size if is_int(size) and size > 0 else 1 for size in (  # verl's types check the rest
            pick(config, f"{ROLLOUT}.data_parallel_size", 1), pick(config, f"{ROLLOUT}.pipeline_model_parallel_size", 1)))
        if world % infer:
            found.append(Problem(f"{ROLLOUT}.tensor_model_parallel_size",
                                 f"vLLM's {infer} GPUs per replica do not divide the {world} GPUs (verl asserts it when "
                                 "the workers start)", "choose a divisor of the GPU count (the paper's configs: 1, 2 "
                                 "or 4)", tp))
        elif tp > gpus or gpus % tp:
            found.append(Problem(f"{ROLLOUT}.tensor_model_parallel_size",
                                 f"vLLM's tensor-parallel group must sit within one node of {gpus} GPUs: vLLM refuses "
                                 "a larger one, and one that does not divide a node straddles two (verl starts each "
                                 "replica on one node)", f"choose a divisor of trainer.n_gpus_per_node={gpus} (the paper's "
                                 "configs: 1, 2 or 4)", tp))
    if world and batch and rollout_n:
        step = world // math.gcd(world, rollout_n)
        if (batch * rollout_n) % world:
            found.append(Problem(
                "data.train_batch_size", f"{batch} prompts x {rollout_n} responses = {batch * rollout_n} "
                f"sequences per step do not split evenly over the {world} GPUs (verl's own check, skipped with "
                "dynamic batching)", f"use a multiple of {step}, e.g. data.train_batch_size="
                f"{max(step, batch // step * step)}", batch))
    if batch and mini and batch % mini:  # a mini-batch larger than the batch too
        found.append(Problem(
            f"{ACTOR}.ppo_mini_batch_size", f"does not divide data.train_batch_size={batch}: every PPO update "
            "takes one mini-batch of the step's prompts", f"choose a divisor of {batch} (the paper: 64, 4 updates "
            "per step)", mini))
    if world and sp and mini and rollout_n and world % sp == 0:
        dp = world // sp
        if (mini * rollout_n) % dp:
            found.append(Problem(
                f"{ACTOR}.ppo_mini_batch_size", f"{mini} prompts x {rollout_n} responses = "
                f"{mini * rollout_n} sequences per update do not split evenly over the {dp} data-parallel ranks "
                "(verl's train_mini_batch asserts it)",
                f"make {ACTOR}.ppo_mini_batch_size x {ROLLOUT}.n a multiple of {dp}", mini))
        elif not pick(config, f"{ACTOR}.use_dynamic_bsz", False):
            micro = get(f"{ACTOR}.ppo_micro_batch_size_per_gpu", "the sequences per micro-batch")
            per_rank = mini * rollout_n // dp
            if micro and per_rank % micro:
                found.append(Problem(f"{ACTOR}.ppo_micro_batch_size_per_gpu",
                                     f"does not divide the {per_rank} sequences of a mini-batch on each rank",
                                     f"choose a divisor of {per_rank}", micro))

    dynamic = pick(config, f"{ACTOR}.use_dynamic_bsz", False)
    if bool(pick(config, f"{ROLLOUT}.log_prob_use_dynamic_bsz", False)) != bool(dynamic):
        found.append(Problem(f"{ROLLOUT}.log_prob_use_dynamic_bsz",
                             f"differs from {ACTOR}.use_dynamic_bsz={dynamic} (verl's worker asserts they agree)",
                             "set both to the same value"))
    longest = prompt + response if prompt and response else None
    passes = [(f"{ACTOR}.use_dynamic_bsz", f"{ACTOR}.ppo_max_token_len_per_gpu",
               f"{ACTOR}.ppo_micro_batch_size_per_gpu", sp),
              (f"{ROLLOUT}.log_prob_use_dynamic_bsz", f"{ROLLOUT}.log_prob_max_token_len_per_gpu",
               f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", sp)]
    if uses_reference(config):
        ref_sp = get(f"{REF}.ulysses_sequence_parallel_size", "the reference's sequence parallel size")
        passes.append((f"{REF}.log_prob_use_dynamic_bsz", f"{REF}.log_prob_max_token_len_per_gpu",
                       f"{REF}.log_prob_micro_batch_size_per_gpu", ref_sp))
    for dynamic_key, budget_key, micro_key, size in passes:
        if pick(config, dynamic_key, False):
            budget = get(budget_key, "a token budget")
            if budget and longest and size and budget * size < longest:
                need = math.ceil(longest / size)
                found.append(Problem(
                    budget_key, f"less than the longest sequence, data.max_prompt_length + "
                    f"data.max_response_length = {longest} tokens" + (f" (over sequence parallel size {size}: "
                                                                       f"{need} per GPU)" if size > 1 else "")
                    + " (verl refuses such a micro-batch at the first long response)",
                    f"set {budget_key} >= {need}, or raise the sequence parallel size", budget))
        elif micro_key != f"{ACTOR}.ppo_micro_batch_size_per_gpu":
            get(micro_key, "the sequences per micro-batch")
    gpu_mem = pick(config, "recipe.gpu_mem_gb")
    problem = gpu_mem_problem(gpu_mem)
    if problem:
        found.append(Problem("recipe.gpu_mem_gb", problem, "set GPU_MEM_GB (or recipe.gpu_mem_gb) to the memory "
                             "torch.cuda.get_device_properties(0).total_memory / 2**30 reports on the target card, "
                             "e.g. 79.1 for an 80 GB card (docs/memory.md lists common cards)", gpu_mem))
    mode = pick(config, "recipe.memory_check", "refuse")
    if mode not in MEMORY_CHECK_MODES:
        found.append(Problem("recipe.memory_check", "unknown mode", f"use one of {list(MEMORY_CHECK_MODES)}", mode))
    return len(found) == before


#: bytes per token the trainer holds for every sequence of a step, at least: three int64 tensors
STEP_BYTES_PER_TOKEN = 3 * 8


def check_step_host_memory(config: DictConfig, found: list[Problem], submit: bool = False,
                           memory: Optional[int] = None) -> None:
    """A step's sequences, which verl's trainer holds whole, fit ``memory`` (default: this machine's)."""
    values = [pick(config, k) for k in ("data.train_batch_size", f"{ROLLOUT}.n", "data.max_prompt_length",
                                        "data.max_response_length")]
    if submit or not all(is_int(v) and v > 0 for v in values):
        return
    batch, n, prompt, response = values
    need = batch * n * (prompt + response) * STEP_BYTES_PER_TOKEN
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory:
        fit = max(1, memory // (batch * (prompt + response) * STEP_BYTES_PER_TOKEN))
        found.append(Problem(
            f"{ROLLOUT}.n", f"a step of data.train_batch_size={batch} prompts x {n} responses of up to {prompt} + "
            f"{response} tokens is held whole by the trainer: at least {need / 2**30:,.0f} GiB (input_ids, "
            f"attention_mask, position_ids alone), more than this machine's {memory / 2**30:,.1f} GiB; the first step "
            "would fail after Ray, the model load and vLLM's start",
            f"set {ROLLOUT}.n to a group size the trainer can hold (at most {fit:,} here; the paper: 8)", n))


def gpu_mem_problem(value) -> Optional[str]:
    """What is wrong with ``recipe.gpu_mem_gb`` (None: a number in (0, :data:`MAX_GPU_MEM_GB`])."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool):
        return "the target GPU's memory in GiB must be a number, not true/false"
    if not math.isfinite(number) or number <= 0:
        return "the target GPU's memory in GiB must be a positive number"
    if number > MAX_GPU_MEM_GB:
        return (f"{number:g} GiB is more than any accelerator has (at most {MAX_GPU_MEM_GB:g} GiB: 288 GB on AMD's "
                "MI355X and NVIDIA's B300), and would make the memory check pass every config; GPU_MEM_GB is GiB "
                "per GPU, not MiB or bytes")
    return None


def uses_reference(config: DictConfig) -> bool:
    """verl builds a reference model for a KL loss or a KL penalty in the reward."""
    return bool(pick(config, f"{ACTOR}.use_kl_loss", False)) or bool(pick(config, "algorithm.use_kl_in_reward", False))
