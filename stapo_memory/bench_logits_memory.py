"""Peak memory of the logits-side computations of verl's log-prob pass, measured against the memory
model's numbers (``stapo_memory/terms.py``).

    python -m stapo_memory.bench_logits_memory                       # CPU: 4096 tokens x 151,936 vocabulary
    python -m stapo_memory.bench_logits_memory --tokens 2048 --json rows.json
    python -m stapo_memory.bench_logits_memory --device cuda --tokens 16384   # under CUDA autocast (bf16)

Each case runs one computation on ``(tokens, vocab)`` bfloat16 logits that exist before it and
records the peak bytes it allocates beside them (:func:`peak_extra_bytes`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import sys
from pathlib import Path
from typing import Callable

import torch

from stapo_core.fileio import atomic_write

from .terms import BF16, SUM_PI_SQUARED_CHUNK_ROWS, entropy_extra_bytes, logits_bytes, sum_pi_squared_extra_bytes

MIB = 1024**2
CASES = ("logits", "sum_pi_squared_verl", "sum_pi_squared_chunked", "entropy_chunked", "log_probs")


def proc_status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: the CPU measurement needs Linux")


def mmap_large_allocations() -> None:
    """glibc: serve allocations >= 64 KiB with mmap (fixed threshold), so freed tensors leave the RSS."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def peak_extra_bytes(fn: Callable[[], object], device: str) -> float:
    """Peak bytes ``fn()`` allocates beyond what is allocated before it (its result included): on CPU the
    resident-set high-water mark (about 1 MiB of noise), on CUDA ``max_memory_allocated`` under bfloat16
    autocast as verl's engine runs."""
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            result = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base_kb = proc_status_kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        result = fn()
        peak = max(0, proc_status_kb("VmHWM") - base_kb) * 1024
    del result
    return float(peak)


@contextlib.contextmanager
def cuda_autocast_logsumexp(device: str):
    """On CPU: ``torch.logsumexp`` of a half-precision input casts it to float32 first (the CUDA
    autocast policy; on CUDA the real autocast applies)."""
    if device == "cuda":
        yield
        return
    original = torch.logsumexp

    def logsumexp(x, dim, keepdim=False):
        # the input stays referenced while the float32 copy is used, as in the autocast dispatcher
        cast = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        return original(cast, dim, keepdim)

    torch.logsumexp = logsumexp
    try:
        yield
    finally:
        torch.logsumexp = original


def modelled_bytes(case: str, tokens: int, vocab: int, chunk: int = SUM_PI_SQUARED_CHUNK_ROWS) -> float:
    """The memory model's number for ``case`` (bfloat16 logits, ``chunk`` rows per chunk): beside the
    logits, a computation's temporaries and its float32 output per token."""
    if case == "logits":
        return logits_bytes(tokens, vocab, BF16)
    extra = {"sum_pi_squared_verl": lambda: sum_pi_squared_extra_bytes(tokens, vocab, BF16, chunk=None),
             "sum_pi_squared_chunked": lambda: sum_pi_squared_extra_bytes(tokens, vocab, BF16, chunk=chunk),
             "entropy_chunked": lambda: entropy_extra_bytes(tokens, vocab, chunk=chunk),
             "log_probs": lambda: 0.0}
    if case not in extra:
        raise ValueError(f"unknown case {case!r}: expected one of {CASES}")
    return extra[case]() + 4.0 * tokens


def run_cases(tokens: int, vocab: int, device: str = "cpu", cases=CASES, chunk: int = SUM_PI_SQUARED_CHUNK_ROWS,
              seed: int = 0) -> list[dict]:
    """Measure each case once (``chunk``: rows per chunk of the chunked cases); rows of ``case, tokens,
    vocab, chunk, measured_bytes, model_bytes, ratio``."""
    import verl_patches.activate  # the recipe's patches, as in every verl process  # noqa: F401
    from verl.utils import torch_functional as verl_F

    from verl_patches.registry import original_of  # verl's own functions under the recipe's patches
    from verl_patches.sum_pi_squared import sum_pi_squared_chunked

    if device == "cpu":
        mmap_large_allocations()
    verl_sum_pi_squared = original_of(verl_F.calculate_sum_pi_squared_from_logits)
    gen = torch.Generator(device=device).manual_seed(seed)
    labels = torch.randint(0, vocab, (tokens,), generator=gen, device=device)

    def make_logits():
        return torch.empty(tokens, vocab, dtype=torch.bfloat16, device=device).normal_(0.0, 3.0, generator=gen)

    functions = {
        "sum_pi_squared_verl": lambda x, y: verl_sum_pi_squared(x),
        "sum_pi_squared_chunked": lambda x, y: sum_pi_squared_chunked(x, chunk_rows=chunk),
        "entropy_chunked": lambda x, y: verl_F.entropy_from_logits_with_chunking(x, chunk_size=chunk),
        "log_probs": lambda x, y: verl_F.logprobs_from_logits(x, y),
    }
    rows = []
    for case in cases:
        if case == "logits":
            measured = peak_extra_bytes(make_logits, device)
        else:
            fn = functions[case]
            with torch.no_grad(), cuda_autocast_logsumexp(device):
                fn(torch.zeros(8, vocab, dtype=torch.bfloat16, device=device), labels[:8])  # warm-up: lazy init
                logits = make_logits()
                measured = peak_extra_bytes(lambda: fn(logits, labels), device)
            del logits
        model = modelled_bytes(case, tokens, vocab, chunk)
        rows.append({"case": case, "tokens": tokens, "vocab": vocab, "chunk": chunk, "device": device,
                     "measured_bytes": measured,
                     "model_bytes": model, "ratio": measured / model if model else float("nan")})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stapo_memory.bench_logits_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--chunk", type=int, default=SUM_PI_SQUARED_CHUNK_ROWS,
                   help="rows per chunk of the chunked cases (default: the recipe's and verl's 2048)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run_cases(args.tokens, args.vocab, args.device, tuple(args.cases.split(",")), chunk=args.chunk)
    print("| case | tokens x vocab | measured MiB | model MiB | measured / model |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['tokens']} x {r['vocab']} | {r['measured_bytes'] / MIB:.0f} | "
              f"{r['model_bytes'] / MIB:.0f} | {r['ratio']:.2f} |")
    if args.json:
        atomic_write(args.json, json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
