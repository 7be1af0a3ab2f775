"""How many S2T decisions change when the same sequences are forwarded in another batch.

A sequence's log-probs and entropies depend, in floating point, on what else is in its forward batch;
this measures how far that moves S2T's selection (the forwards, dtypes and measured numbers:
benchmarks/README.md).

::

    python -m benchmarks.bench_forward_composition [--model DIR] [--sequences 8] [--length 160]
        [--tau-p 0.002,0.05] [--seed 0] [--json]

``--model`` defaults to the CPU assets' tiny Qwen3 (``$STAPO_CPU_ASSETS_DIR/model``, built by
``python -m stapo_cpu.assets`` when missing).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from benchmarks.common import markdown_table
from stapo_core.s2t import s2t_mask


def silenced_set_difference(keep_a: torch.Tensor, keep_b: torch.Tensor, response_mask: torch.Tensor) -> int:
    """Tokens silenced by exactly one of two keep masks of the same tokens (the size of the symmetric
    difference of the two silenced sets), counting only tokens of ``response_mask``.

    Raises:
        ValueError: the three shapes differ.
    """
    if not (keep_a.shape == keep_b.shape == response_mask.shape):
        raise ValueError(f"silenced_set_difference: shapes differ: keep_a {tuple(keep_a.shape)}, "
                         f"keep_b {tuple(keep_b.shape)}, response_mask {tuple(response_mask.shape)}")
    differs = (keep_a != 0) != (keep_b != 0)
    return int((differs & (response_mask != 0)).sum())


@dataclass
class Composition:
    """One dtype and ``tau_p``: noise and flips between two forwards of the same sequences: the largest
    change of a token's log-prob / entropy between the full forward and the positive-advantage one (or
    each sequence alone), S2T's candidates and silenced tokens in the full forward, the tokens silenced
    by exactly one of two forwards, and how many of those lie within ``tolerance`` of a threshold (all
    of them when floating point is the only cause)."""

    dtype: str
    tau_p: float
    tokens: int
    max_dlogp_full_vs_positive: float
    max_dentropy_full_vs_positive: float
    max_dlogp_full_vs_alone: float
    candidates: int
    silenced: int
    flips_full_vs_positive: int
    flips_full_vs_alone: int
    tolerance: float
    flips_near_threshold: int


TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}
"""Distance to a threshold (in ``log p`` and nats of entropy) within which a flip is put down to
floating point, per forward dtype: well above each dtype's measured batch-composition noise."""


def forward_statistics(model, sequences: Sequence[torch.Tensor], prompt_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_prob, entropy)`` of the response tokens of ``sequences`` forwarded in ONE right-padded
    batch, as ``(len(sequences), width)`` float32 tensors (zero beyond each response)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], attention[i, : len(s)] = s, 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits.float()
    logp_all = torch.log_softmax(logits[:, prompt_len - 1 : -1], dim=-1)
    targets = ids[:, prompt_len:]
    log_prob = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    valid = attention[:, prompt_len:].float()
    return log_prob * valid, entropy * valid


def _stack(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[0])) for r in rows])


def sample_sequences(model, vocab: int, n: int, length: int, prompt_len: int, seed: int, n_special: int = 4) -> list[torch.Tensor]:
    """``n`` prompts of random tokens, each continued by tokens sampled at temperature 1 and cut to
    different lengths (``length`` down to about half of it), so that a padded batch pads them."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(n_special, vocab, (n, prompt_len), generator=g)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=length, min_new_tokens=length, pad_token_id=0)
    return [row[: prompt_len + length - (i * 37) % max(1, length // 2)] for i, row in enumerate(out)]


def measure(model, sequences: list[torch.Tensor], advantages: torch.Tensor, prompt_len: int, tau_p: float, q: float = 0.75,
            pad_id: int = 0) -> Composition:
    """Forward ``sequences`` in one batch, the positive-advantage ones in one batch, and each alone, and
    compare the statistics and S2T's selections of the three."""
    n, width = len(sequences), max(len(s) for s in sequences) - prompt_len
    lengths = torch.tensor([len(s) - prompt_len for s in sequences])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    adv = advantages[:, None].expand(n, width).clone()
    full_lp, full_h = forward_statistics(model, sequences, prompt_len, pad_id)
    full_lp, full_h = full_lp[:, :width], full_h[:, :width]
    positive = [i for i in range(n) if advantages[i] > 0]
    pos_lp, pos_h = forward_statistics(model, [sequences[i] for i in positive], prompt_len, pad_id)
    alone = [forward_statistics(model, [s], prompt_len, pad_id) for s in sequences]
    alone_lp = _stack([a[0][0] for a in alone], width)
    alone_h = _stack([a[1][0] for a in alone], width)
    # the positive-advantage forward's statistics, placed in the full batch (the rest are never candidates)
    part_lp, part_h = full_lp.clone(), full_h.clone()
    part_lp[positive], part_h[positive] = _stack(list(pos_lp[:, :width]), width), _stack(list(pos_h[:, :width]), width)
    reference = s2t_mask(full_lp, full_h, adv, mask, tau_p=tau_p, q=q)
    other = s2t_mask(part_lp, part_h, adv, mask, tau_p=tau_p, q=q)
    single = s2t_mask(alone_lp, alone_h, adv, mask, tau_p=tau_p, q=q)
    on_positive = mask.bool() & (adv > 0)
    dlogp = (full_lp - part_lp).abs()[on_positive]
    dent = (full_h - part_h).abs()[on_positive]
    flipped = (reference.keep != other.keep) & mask.bool()
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    tolerance = TOLERANCE.get(dtype, 0.1)
    near = _near_threshold(flipped, full_lp, full_h, tau_p, reference.stats["tau_h"], other.stats["tau_h"], tolerance)
    candidates = (on_positive & (full_lp.exp() < tau_p)).sum()
    return Composition(
        dtype=dtype,
        tau_p=tau_p,
        tokens=int(mask.sum()),
        max_dlogp_full_vs_positive=float(dlogp.max()) if dlogp.numel() else 0.0,
        max_dentropy_full_vs_positive=float(dent.max()) if dent.numel() else 0.0,
        max_dlogp_full_vs_alone=float((full_lp - alone_lp).abs()[mask.bool()].max()),
        candidates=int(candidates),
        silenced=int(((reference.keep == 0) & mask.bool()).sum()),
        flips_full_vs_positive=silenced_set_difference(reference.keep, other.keep, mask),
        flips_full_vs_alone=silenced_set_difference(reference.keep, single.keep, mask),
        tolerance=tolerance,
        flips_near_threshold=near,
    )


def _near_threshold(flipped, log_prob, entropy, tau_p, tau_h_a, tau_h_b, tolerance: float) -> int:
    """Flipped tokens whose full-forward ``log p`` is within ``tolerance`` of ``log tau_p``, or whose
    entropy is within ``tolerance`` (plus the two forwards' difference of ``tau_h``) of ``tau_h``."""
    near = (log_prob - torch.log(torch.tensor(tau_p))).abs() <= tolerance
    tau_a, tau_b = float(tau_h_a), float(tau_h_b)
    if tau_a == tau_a and tau_b == tau_b:  # both defined (not NaN)
        near |= (entropy - tau_a).abs() <= tolerance + abs(tau_a - tau_b)
    return int((flipped & near).sum())


def load_model(path: Optional[str], dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if path is None:
        from stapo_cpu.assets import build_assets

        root = Path(os.environ.get("STAPO_CPU_ASSETS_DIR") or "results/cpu_assets")
        path = str(build_assets(root).root / "model")
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def run(model_path: Optional[str], n: int, length: int, taus: Sequence[float], seed: int, prompt_len: int = 8) -> list[Composition]:
    """Every (dtype, tau_p) measurement; the responses are sampled once, in float32."""
    base = load_model(model_path, torch.float32)
    sequences = sample_sequences(base, base.config.vocab_size, n, length, prompt_len, seed)
    advantages = torch.tensor([1.0 if i % 2 == 1 else -1.0 for i in range(n)])  # the longest (first) is negative
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        model = base if dtype == torch.float32 else load_model(model_path, dtype)
        results += [measure(model, sequences, advantages, prompt_len, tau) for tau in taus]
    return results


def table(results: Sequence[Composition]) -> str:
    header = ("dtype", "tau_p", "tokens", "max dlogp full/positive", "max dH full/positive", "max dlogp full/alone",
              "candidates", "silenced", "flips full/positive", "flips full/alone", "tolerance",
              "flips within it of a threshold")
    return markdown_table(header, ((r.dtype, f"{r.tau_p:g}", r.tokens, f"{r.max_dlogp_full_vs_positive:.2e}",
                                    f"{r.max_dentropy_full_vs_positive:.2e}", f"{r.max_dlogp_full_vs_alone:.2e}",
                                    r.candidates, r.silenced, r.flips_full_vs_positive, r.flips_full_vs_alone,
                                    f"{r.tolerance:g}", r.flips_near_threshold) for r in results))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_forward_composition", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a causal LM folder (default: the CPU assets' tiny Qwen3)")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--length", type=int, default=160, help="response tokens per sequence")
    p.add_argument("--tau-p", default="0.002,0.05", help="comma-separated tau_p values")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    taus = [float(t) for t in args.tau_p.split(",") if t.strip()]
    results = run(args.model, args.sequences, args.length, taus, args.seed)
    print(json.dumps([asdict(r) for r in results], indent=1) if args.json else table(results).rstrip("\n"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
