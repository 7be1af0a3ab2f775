"""Cost of S2T in the policy-loss path: forward + backward of verl's ``ppo_loss`` per loss mode.

::

    python -m benchmarks.bench_loss [--device cpu|cuda] [--repeats N] [--shapes 1x16384,8x4096]
                                    [--vocab 151936] [--d D] [--memory auto|subprocess|inprocess|off]
                                    [--modes vanilla,stapo-rollout,...] [--json out.json] [--quick]

One timed call is one micro-batch as verl's FSDP actor processes it (:func:`loss_step`: the LM head,
verl's log-probs, the entropy where the mode needs it, the S2T fold, verl's token count, the loss as
``verl_patches`` installs it, ``backward``). The modes (:data:`MODES`), the timing statistics, how
peak memory is measured on cuda and on cpu, the targets and the measured numbers:
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from tqdm import tqdm

from benchmarks import common
from benchmarks.common import number, positive, rotated
from stapo_core.fileio import atomic_write
from stapo_memory.bench_logits_memory import mmap_large_allocations, proc_status_kb

MIB = 1024 * 1024
#: resolution of the peak-memory measurement (MiB) and the relative tolerance of "no more memory"
MEM_RESOLUTION_MB = 1.0
MEM_REL_TOL = 0.01
VERL_ENTROPY_CHUNK = 2048  # verl's entropy_from_logits_chunk_size default


@dataclass(frozen=True)
class Target:
    """time_max: bound on median(t_mode / t_vanilla); mem_ref: the mode whose peak this one must not exceed."""

    time_max: float
    mem_ref: str

    def describe(self) -> str:
        return f"time <= {self.time_max:.2f}x vanilla, mem <= {self.mem_ref}"


@dataclass(frozen=True)
class Mode:
    """One loss configuration. overrides: Hydra overrides of the recipe (``compose``); entropy:
    None, ``"grad"``, ``"nograd"`` or ``"candidates"`` (the current entropy computed in the call); fold: apply
    ``fold_into_mini_batch`` (rollout statistics, mini-batch scope); rollout_entropy: the batch
    carries the rollout entropy field (shipped to the actor only when S2T / 20-Entropy need it)."""

    name: str
    overrides: tuple
    entropy: Optional[str] = None
    fold: bool = False
    rollout_entropy: bool = False
    target: Optional[Target] = None
    role: str = ""


_CURRENT = ("actor_rollout_ref.actor.policy_loss.stats_from=current", "actor_rollout_ref.actor.policy_loss.scope=micro_batch",
            "actor_rollout_ref.actor.calculate_entropy=true")
_CURRENT_TARGET = Target(1.10, "vanilla+entropy")

MODES = {
    m.name: m
    for m in (
        Mode("vanilla", ("method=justrl",), role="reference (JustRL)"),
        Mode("vanilla+entropy", ("method=justrl", "actor_rollout_ref.actor.calculate_entropy=true"), entropy="grad",
             role="reference (verl's entropy)"),
        Mode("stapo-rollout", ("method=stapo", "actor_rollout_ref.actor.policy_loss.stats_from=rollout"), fold=True, rollout_entropy=True, target=Target(1.02, "vanilla")),
        Mode("stapo-current", ("method=stapo", *_CURRENT), entropy="grad", target=_CURRENT_TARGET),
        Mode("stapo-current-nograd", ("method=stapo", *_CURRENT), entropy="nograd", target=_CURRENT_TARGET,
             role="proposed fix"),
        Mode("stapo-current-candidates", ("method=stapo", *_CURRENT), entropy="candidates", target=_CURRENT_TARGET,
             role="proposed fix"),
        Mode("entropy_topk", ("method=entropy20",), fold=True, rollout_entropy=True, role="20-Entropy (no target)"),
    )
}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x16384,8x4096"`` -> ``[(1, 16384), (8, 4096)]`` (batch x response length)."""
    shapes = []
    for item in (s.strip() for s in text.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {item!r} is not BATCHxLENGTH with positive integers (e.g. 8x4096)")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def parse_logit_scale(text: str) -> tuple[float, float]:
    """``"0.5,8"`` -> ``(0.5, 8.0)``: 0 < LO <= HI, finite."""
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--logit-scale: {text!r} is not LO,HI (two numbers)") from None
    if not (math.isfinite(high) and 0 < low <= high):
        raise ValueError(f"--logit-scale: {text!r} needs 0 < LO <= HI (finite)")
    return low, high


@dataclass
class LossInputs:
    """One micro-batch and its LM head.

    hidden: float32 ``(T, d)`` leaf with grad, T = sum over sequences of prompt_len + length;
    weight: float32 ``(d, V)`` leaf with grad; labels: int64 ``(T,)`` the token each flat position
    predicts (sampled from the model); flat_positive: bool ``(T,)``, True where the position predicts
    a response token of a positive-advantage sequence (S2T's candidates live there); fields: the padded batch tensors ``prompts``,
    ``responses``, ``attention_mask`` ``(B, P + R)``, ``response_mask`` int64 ``(B, R)``,
    ``old_log_probs``, ``advantages``, ``entropy`` (rollout entropy) float32 ``(B, R)``.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    fields: dict
    flat_positive: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.hidden.shape[0]


def _flat_to_padded(flat: torch.Tensor, fields: dict) -> torch.Tensor:
    """Response slice ``(B, R)`` of a flat ``(T,)`` per-position tensor: verl's own ``no_padding_2_padding``."""
    from tensordict import TensorDict

    from verl.workers.utils.padding import no_padding_2_padding

    keys = ("prompts", "responses", "attention_mask")
    return no_padding_2_padding(flat, TensorDict({k: fields[k] for k in keys}, batch_size=[fields["prompts"].shape[0]]))


@torch.no_grad()
def _sample_tokens(hidden, weight, generator, chunk: int = 512):
    """Per flat position: a token sampled from softmax(hidden @ W) (Gumbel-max), its log-prob and
    the entropy of the distribution. Chunked over rows. Returns ``(labels, log_probs, entropy)``."""
    labels, log_probs, entropy = [], [], []
    for start in range(0, hidden.shape[0], chunk):
        logits = hidden[start : start + chunk] @ weight
        u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20)
        token = torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        labels.append(token)
        log_probs.append(logp.gather(-1, token[:, None]).squeeze(-1))
        entropy.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(labels), torch.cat(log_probs), torch.cat(entropy)


def make_inputs(batch: int, resp_len: int, *, vocab: int, d: int, prompt_len: int, device: str, seed: int,
                logit_scale: tuple[float, float] = (0.5, 8.0)) -> LossInputs:
    """A reproducible micro-batch: sequence 0 has ``resp_len`` response tokens, the others a length
    uniform in [resp_len/2, resp_len] (right padding); advantages +1 / -1 alternating (GRPO signs,
    sequence 0 positive); logits ``N(0, s_t^2)`` per position with s_t log-uniform in ``logit_scale``
    (default [0.5, 8]: entropies from ~1 nat to ~ln V, and S2T candidates, p < 0.002, at about
    half the positions: a stress case; [8, 16]: entropies ~0.5-1.5 nats, candidates ~1%);
    tokens sampled from the model; ``old_log_probs`` =
    the sampled log-probs + N(0, 0.02^2) (policy drift), at most 0; rollout entropy = the model's entropy."""
    if prompt_len < 1:
        raise ValueError(f"--prompt-len={prompt_len}: verl needs at least one prompt token per sequence")
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = [resp_len] + [int(resp_len * (0.5 + 0.5 * torch.rand((), generator=g).item())) for _ in range(batch - 1)]
    lengths = [max(1, n) for n in lengths]
    total = sum(prompt_len + n for n in lengths)
    low, high = logit_scale
    scale = torch.exp(torch.empty(total).uniform_(math.log(low), math.log(high), generator=g))
    hidden = (torch.randn(total, d, generator=g) * scale[:, None]).to(device)
    weight = (torch.randn(d, vocab, generator=g) / math.sqrt(d)).to(device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    labels, log_probs, entropy = _sample_tokens(hidden, weight, gen)

    response_mask = (torch.arange(resp_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    fields = {
        "prompts": torch.ones(batch, prompt_len, dtype=torch.long),
        "responses": torch.ones(batch, resp_len, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(batch, prompt_len, dtype=torch.long), response_mask], dim=1),
        "response_mask": response_mask,
    }
    fields = {k: v.to(device) for k, v in fields.items()}
    old = _flat_to_padded(log_probs, fields)
    # a log-probability of the drifted policy is still <= 0 (stapo_core refuses one above it)
    fields["old_log_probs"] = (old + 0.02 * torch.randn(old.shape, generator=g).to(device)).clamp(max=0.0)
    signs = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(batch)], device=device)
    fields["advantages"] = signs[:, None].expand(batch, resp_len).contiguous()
    fields["entropy"] = _flat_to_padded(entropy, fields)
    flat_positive = torch.zeros(total, dtype=torch.bool)
    start = 0
    for i, n in enumerate(lengths):  # the output at position p predicts token p + 1
        flat_positive[start + prompt_len - 1 : start + prompt_len - 1 + n] = signs[i].item() > 0
        start += prompt_len + n
    return LossInputs(hidden.requires_grad_(True), weight.requires_grad_(True), labels, fields, flat_positive.to(device))


def make_batch(inputs: LossInputs, mode: Mode):
    """A fresh micro-batch TensorDict (the fold edits it in place) in the legacy trainer's layout."""
    from tensordict import TensorDict

    from verl.utils import tensordict_utils as tu

    keys = ["prompts", "responses", "attention_mask", "response_mask", "old_log_probs", "advantages"]
    fields = {k: inputs.fields[k] for k in keys}
    fields["response_mask"] = fields["response_mask"].clone()
    fields["loss_mask"] = fields["response_mask"].clone()
    if mode.rollout_entropy:
        fields["entropy"] = inputs.fields["entropy"]
    data = TensorDict(fields, batch_size=[fields["prompts"].shape[0]])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=fields["prompts"].shape[0])
    return data


@lru_cache(maxsize=None)
def actor_config(mode_name: str):
    """The actor config (verl dataclass) the recipe composes for ``mode_name``."""
    import verl_patches.activate  # noqa: F401  (installs the patches, registers the losses)
    from recipe.stapo.driver import compose
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose([*MODES[mode_name].overrides, "model=qwen3_1_7b"])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def entropy_function(chunk: int, compile: bool = False) -> Callable:
    """verl's entropy over the vocabulary: chunked (``chunk`` rows) or, for 0, unchunked; with
    ``compile``, wrapped in ``torch.compile(dynamic=True)`` as verl's FSDP engine does by default
    (``use_torch_compile``)."""
    from verl.utils import torch_functional as verl_F

    if chunk < 0:
        raise ValueError(f"--entropy-chunk={chunk}: expected 0 (unchunked) or a positive row count")
    fn = verl_F.entropy_from_logits_with_chunking if chunk else verl_F.entropy_from_logits
    if compile:
        fn = torch.compile(fn, dynamic=True)
    return partial(fn, chunk_size=chunk) if chunk else fn


@torch.no_grad()
def candidate_entropy(logits, log_probs, positive, tau_p: float, entropy_fn: Callable) -> torch.Tensor:
    """Entropy ``(T,)`` float32 at S2T's candidate positions only (``positive`` and
    ``exp(log_prob) < tau_p``), 0 elsewhere, without grad: S2T reads the entropy only there (the
    mask and tau_h are exactly those of the full entropy). One host sync (the candidate count)."""
    rows = torch.nonzero(positive & (log_probs.detach().exp() < tau_p)).squeeze(-1)
    entropy = torch.zeros(log_probs.shape, dtype=torch.float32, device=log_probs.device)
    if rows.numel():
        entropy[rows] = entropy_fn(logits.detach().index_select(0, rows)).float()
    return entropy


def loss_step(mode: Mode, inputs: LossInputs, data, entropy_fn: Callable) -> torch.Tensor:
    """One forward + backward of the policy-loss path: the S2T fold for rollout statistics, verl's
    token count, the LM head ``logits = hidden (T x d) @ W (d x V)``, verl's log-probs, the mode's
    entropy (with grad as verl's actor computes it, without, or only at S2T's candidates), verl's
    ``ppo_loss`` as installed, ``backward`` into ``W`` and ``hidden``. Returns the loss."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.torch_functional import logprobs_from_logits
    from verl_patches.losses import ppo_loss_with_token_selection
    from verl_patches.token_selection import fold_into_mini_batch

    config = actor_config(mode.name)
    if mode.fold:
        fold_into_mini_batch(config.policy_loss, data)
    tu.assign_non_tensor(data, batch_num_tokens=int(data["loss_mask"].sum()))
    logits = inputs.hidden @ inputs.weight  # (T, V)
    model_output = {"log_probs": logprobs_from_logits(logits, inputs.labels, inplace_backward=mode.entropy is None)}
    if mode.entropy == "grad":
        model_output["entropy"] = entropy_fn(logits)
    elif mode.entropy == "nograd":
        with torch.no_grad():
            model_output["entropy"] = entropy_fn(logits)
    elif mode.entropy == "candidates":
        model_output["entropy"] = candidate_entropy(logits, model_output["log_probs"], inputs.flat_positive,
                                                    config.policy_loss.tau_p, entropy_fn)
    loss, _ = ppo_loss_with_token_selection(config=config, model_output=model_output, data=data)
    loss.backward()
    return loss.detach()


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _settle(modes: Sequence[Mode]) -> None:
    """Compose the modes' configs, then move every live Python object out of the garbage
    collector's reach (``gc.freeze``), so the per-call ``gc.collect`` costs milliseconds, not the
    ~0.3 s a full collection over verl's and Hydra's objects takes."""
    for mode in modes:
        actor_config(mode.name)
    gc.collect()
    gc.freeze()


def _prepare(mode: Mode, inputs: LossInputs):
    """Fresh batch, no stale gradients, garbage collected: the state before every measured call."""
    inputs.hidden.grad = None
    inputs.weight.grad = None
    data = make_batch(inputs, mode)
    gc.collect()
    return data


def timed_call(mode: Mode, inputs: LossInputs, entropy_fn: Callable, device: str) -> float:
    """Seconds of one :func:`loss_step` (batch construction excluded)."""
    data = _prepare(mode, inputs)
    _synchronize(device)
    start = time.perf_counter()
    loss_step(mode, inputs, data, entropy_fn)
    _synchronize(device)
    elapsed = time.perf_counter() - start
    if not math.isfinite(elapsed) or elapsed <= 0:
        raise RuntimeError(f"timer returned {elapsed} for mode {mode.name}")
    return elapsed


def time_modes(modes: Sequence[Mode], inputs: LossInputs, entropy_fn, device: str, repeats: int, warmup: int,
               label: str = "") -> dict[str, list[float]]:
    """Seconds per mode and round; rounds interleave the modes, rotating their order."""
    for _ in range(warmup):
        for mode in modes:
            timed_call(mode, inputs, entropy_fn, device)
    times = {m.name: [] for m in modes}
    for r in tqdm(range(repeats), desc=f"timing {label}", leave=False, file=sys.stderr):
        for mode in rotated(modes, r):
            times[mode.name].append(timed_call(mode, inputs, entropy_fn, device))
    return times


def peak_memory_mb(mode: Mode, inputs: LossInputs, entropy_fn: Callable, device: str) -> float:
    """Peak memory (MiB) one :func:`loss_step` allocates over what was allocated before it."""
    data = _prepare(mode, inputs)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss_step(mode, inputs, data, entropy_fn)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / MIB
    base_kb = proc_status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    loss_step(mode, inputs, data, entropy_fn)
    return max(0, proc_status_kb("VmHWM") - base_kb) / 1024


def peak_memory_subprocess(args: argparse.Namespace, mode: str, shape: tuple[int, int]) -> float:
    """:func:`peak_memory_mb` of ``mode`` in a fresh Python process (same inputs, same seed)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(_peak_memory_child, args, mode, shape).result()


def _peak_memory_child(args: argparse.Namespace, mode_name: str, shape: tuple[int, int]) -> float:
    """The fresh process of :func:`peak_memory_subprocess`: one warm-up call, then the measured one."""
    if args.device == "cpu":
        mmap_large_allocations()  # before the inputs exist: RSS then follows the allocations
    torch.set_num_threads(args.threads)
    mode = MODES[mode_name]
    inputs = make_inputs(*shape, vocab=args.vocab, d=args.d, prompt_len=args.prompt_len, device=args.device,
                         seed=args.seed, logit_scale=args.logit_scale)
    entropy_fn = entropy_function(args.entropy_chunk, args.compile_entropy == "on")
    _settle([mode])
    try:
        timed_call(mode, inputs, entropy_fn, args.device)  # warm-up (lazy initialisation, config compose)
        return peak_memory_mb(mode, inputs, entropy_fn, args.device)
    finally:
        gc.unfreeze()  # the process's objects are freed when it exits


def time_s2t_alone(inputs: LossInputs, repeats: int, device: str) -> dict[str, float]:
    """Median ms of the S2T work alone: ``fold_into_mini_batch`` (rollout statistics) and the
    mask inside the loss (``select_tokens`` on current statistics), on this batch; with the
    batch's S2T counts (response tokens, candidates, silenced)."""
    from verl_patches.token_selection import fold_into_mini_batch
    from verl_patches.token_selection import select_tokens

    fold_cfg = actor_config("stapo-rollout").policy_loss
    current_cfg = actor_config("stapo-current").policy_loss
    f = inputs.fields
    fold_ms, mask_ms, metrics = [], [], {}
    for _ in range(max(repeats, 5)):
        data = _prepare(MODES["stapo-rollout"], inputs)
        _synchronize(device)
        t0 = time.perf_counter()
        metrics = fold_into_mini_batch(fold_cfg, data)
        _synchronize(device)
        t1 = time.perf_counter()
        select_tokens(current_cfg, log_prob=f["old_log_probs"], entropy=f["entropy"], advantages=f["advantages"],
                      response_mask=f["response_mask"].float())
        _synchronize(device)
        t2 = time.perf_counter()
        fold_ms.append((t1 - t0) * 1e3)
        mask_ms.append((t2 - t1) * 1e3)
    return {"fold_ms": statistics.median(fold_ms), "mask_ms": statistics.median(mask_ms),
            "tokens": metrics["s2t/tokens"], "candidates": metrics["s2t/candidates"], "silenced": metrics["s2t/silenced"]}


@dataclass
class Row:
    mode: str
    shape: str
    tokens: int
    median_ms: float
    ratio_time: float
    peak_mb: float
    ratio_mem: float
    target: str
    verdict: str
    times_ms: list


def verdict(mode: Mode, ratio_time: float, peaks: dict[str, float]) -> str:
    """``PASS``, ``MISS (time)``, ``MISS (mem)``, ``MISS (time, mem)``, or ``-`` without a target
    (or ``PASS (time; mem not measured)`` with ``--memory off``)."""
    if mode.target is None:
        return "-"
    missed = [] if ratio_time <= mode.target.time_max else ["time"]
    peak, ref = peaks.get(mode.name), peaks.get(mode.target.mem_ref)
    if peak is None or ref is None:
        return ("MISS (time" if missed else "PASS (time") + "; mem not measured)"
    if peak > ref * (1 + MEM_REL_TOL) + MEM_RESOLUTION_MB:
        missed.append("mem")
    return f"MISS ({', '.join(missed)})" if missed else "PASS"


#: the verdict of a --quick run: too few rounds on tiny shapes to hold a mode to its target
QUICK_VERDICT = "not judged (--quick)"


def build_rows(modes: Sequence[Mode], shape: tuple[int, int], tokens: int, times: dict[str, list[float]],
               peaks: dict[str, float], judge: bool = True) -> list[Row]:
    """Table rows of one shape: medians, paired time ratios, memory ratios, verdicts (``judge``
    False: :data:`QUICK_VERDICT` for every mode with a target)."""
    base = times["vanilla"]
    rows = []
    for mode in modes:
        ratio_time = statistics.median(t / b for t, b in zip(times[mode.name], base))
        peak = peaks.get(mode.name, math.nan)
        ratio_mem = ((peak + MEM_RESOLUTION_MB) / (peaks["vanilla"] + MEM_RESOLUTION_MB)
                     if "vanilla" in peaks and mode.name in peaks else math.nan)
        rows.append(Row(mode.name, f"{shape[0]}x{shape[1]}", tokens, statistics.median(times[mode.name]) * 1e3,
                        ratio_time, peak, ratio_mem, mode.target.describe() if mode.target else mode.role,
                        verdict(mode, ratio_time, peaks) if judge or mode.target is None else QUICK_VERDICT,
                        [t * 1e3 for t in times[mode.name]]))
    return rows


def markdown_table(rows: Sequence[Row]) -> str:
    header = ("mode", "shape (T flat tokens)", "median ms", "ratio time", "peak MB", "ratio mem", "target", "PASS/MISS")
    return common.markdown_table(header, ((r.mode, f"{r.shape} ({r.tokens})", number(r.median_ms, 1),
                                           number(r.ratio_time, 3), number(r.peak_mb, 1), number(r.ratio_mem, 3),
                                           r.target, r.verdict) for r in rows))


def machine_description(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads (torch {torch.__version__})")


def _selected_modes(text: Optional[str]) -> list[Mode]:
    """The requested modes plus the references their ratios and targets need, in MODES order."""
    names = list(MODES) if text is None else [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown mode(s) {unknown}: expected some of {list(MODES)}")
    wanted = set(names) | {"vanilla"} | {MODES[n].target.mem_ref for n in names if MODES[n].target}
    return [m for name, m in MODES.items() if name in wanted]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=positive(int), default=None, help="timed rounds (default 7; --quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds (default 1)")
    p.add_argument("--shapes", default=None,
                   help="BATCHxRESPONSE_LEN list (default 1x16384,8x4096 on cuda; 1x2048,4x512 on cpu)")
    p.add_argument("--vocab", type=positive(int), default=None, help="vocabulary size (default 151936, Qwen3)")
    p.add_argument("--d", type=positive(int), default=None, help="hidden size of the LM head (default 4096 cuda, 128 cpu)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (default 32)")
    p.add_argument("--entropy-chunk", type=int, default=VERL_ENTROPY_CHUNK,
                   help="rows per chunk of verl's entropy (default 2048, verl's; 0 = unchunked)")
    p.add_argument("--compile-entropy", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile verl's entropy as its FSDP engine does (auto: on for cuda, off for cpu)")
    p.add_argument("--modes", default=None, help=f"comma list of {list(MODES)} (default all)")
    p.add_argument("--memory", choices=("auto", "subprocess", "inprocess", "off"), default="auto",
                   help="peak memory: auto = inprocess on cuda, subprocess on cpu (inprocess with --quick)")
    p.add_argument("--threads", type=positive(int), default=1,
                   help="torch CPU threads (default 1: on a shared machine OpenMP spin-waits make more threads "
                        "slower and far noisier)")
    p.add_argument("--logit-scale", default="0.5,8",
                   help="LO,HI: per-position logit std, log-uniform (default 0.5,8: S2T candidates at ~half the "
                        "positions, a stress case; 8,16: ~1%%, closer to an LLM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test (seconds)")
    args = p.parse_args(argv)
    quick = {"repeats": 3, "shapes": "1x256,2x128", "vocab": 8192, "d": 32}
    full = {"repeats": 7, "shapes": "1x16384,8x4096" if args.device == "cuda" else "1x2048,4x512", "vocab": 151936,
            "d": 4096 if args.device == "cuda" else 128}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.compile_entropy == "auto":
        args.compile_entropy = "on" if args.device == "cuda" else "off"
    if args.memory == "auto":
        args.memory = "inprocess" if args.device == "cuda" or args.quick else "subprocess"
    try:
        args.shapes = parse_shapes(args.shapes)
        args.logit_scale = parse_logit_scale(args.logit_scale)
        args.mode_list = _selected_modes(args.modes)
        if args.warmup < 0:
            raise ValueError(f"--warmup={args.warmup}: expected >= 0")
        entropy_function(args.entropy_chunk)
    except ValueError as e:
        p.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def benchmark_shape(args: argparse.Namespace, shape: tuple[int, int]) -> tuple[list[Row], dict]:
    """Time (and measure) every selected mode on one shape. Returns the rows and S2T-alone timings."""
    inputs = make_inputs(*shape, vocab=args.vocab, d=args.d, prompt_len=args.prompt_len, device=args.device,
                         seed=args.seed, logit_scale=args.logit_scale)
    entropy_fn = entropy_function(args.entropy_chunk, args.compile_entropy == "on")
    _settle(args.mode_list)
    label = f"{shape[0]}x{shape[1]}"
    times = time_modes(args.mode_list, inputs, entropy_fn, args.device, args.repeats, args.warmup, label)
    peaks = {}
    if args.memory != "off":
        for mode in tqdm(args.mode_list, desc=f"peak memory {label}", leave=False, file=sys.stderr):
            peaks[mode.name] = (peak_memory_mb(mode, inputs, entropy_fn, args.device) if args.memory == "inprocess"
                                else peak_memory_subprocess(args, mode.name, shape))
    alone = time_s2t_alone(inputs, args.repeats, args.device)
    alone["vanilla_ms"] = statistics.median(times["vanilla"]) * 1e3
    return build_rows(args.mode_list, shape, inputs.tokens, times, peaks, judge=not args.quick), alone


def run(args: argparse.Namespace) -> None:
    """Benchmark every shape and print the table."""
    if args.device == "cpu":
        mmap_large_allocations()  # before the inputs exist: RSS then follows the allocations
    torch.manual_seed(args.seed)
    rows, notes = [], []
    for shape in args.shapes:
        shape_rows, alone = benchmark_shape(args, shape)
        rows += shape_rows
        notes.append(
            f"- {shape[0]}x{shape[1]}: S2T alone: fold_into_mini_batch {alone['fold_ms']:.2f} ms "
            f"({100 * alone['fold_ms'] / alone['vanilla_ms']:.2f}% of vanilla), mask from current statistics "
            f"{alone['mask_ms']:.2f} ms ({100 * alone['mask_ms'] / alone['vanilla_ms']:.2f}% of vanilla); batch: "
            f"{alone['tokens']:.0f} response tokens, {alone['candidates']:.0f} S2T candidates "
            f"({100 * alone['candidates'] / max(alone['tokens'], 1):.1f}%), {alone['silenced']:.0f} silenced"
        )
    print(f"bench_loss: device {args.device} ({machine_description(args.device)}), V={args.vocab}, d={args.d}, "
          f"prompt {args.prompt_len} tokens/sequence, logit std {args.logit_scale[0]}-{args.logit_scale[1]}, entropy chunk {args.entropy_chunk} "
          f"(compiled: {args.compile_entropy}), threads {args.threads}, repeats {args.repeats} "
          f"(median; ratio = median of paired per-round ratios to vanilla), memory: {args.memory}\n")
    print(markdown_table(rows))
    print("\n".join(notes))
    if args.json:
        atomic_write(args.json, json.dumps([asdict(r) for r in rows], indent=1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        run(args)
    finally:  # leave a calling process (tests) as it was
        torch.set_num_threads(threads)
        gc.unfreeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
