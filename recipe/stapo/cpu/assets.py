"""Tiny offline assets for the CPU path: tokenizer, synthetic math task, warmed-up tiny Qwen3.

CLI::

    python -m recipe.stapo.cpu.assets OUT_DIR [--force]

Writes into ``OUT_DIR``:

- ``model/``: a ``Qwen3ForCausalLM`` (random init with a fixed seed, then a short supervised
  warm-up on the task) saved with ``save_pretrained`` (safetensors), together with its tokenizer
  (a byte-level BPE of ``vocab_size`` tokens trained locally on the task text plus pseudo-word
  filler text, ``PreTrainedTokenizerFast`` with a Qwen-style ``chat_template``, eos
  ``<|im_end|>``, pad ``<|endoftext|>``). verl loads both from this folder.
- ``train.parquet``, ``val.parquet``: addition problems in verl's RL format (``data_source``,
  ``prompt`` = [{"role": "user", "content": ...}], ``ability``, ``reward_model`` =
  {"style": "rule", "ground_truth": ...}, ``extra_info``); every prompt ends with the instruction
  of the real runs. The answer goes in ``\\boxed{}``.
- ``manifest.json``: the config, its hash, file hashes, the warm-up steps, the measured
  sampling success rate at temperature 1.0 (target 20-70%, so GRPO advantages are non-zero) and
  how often sampling at temperature 1.0 draws a token with p < ``tau_p`` (0.002, the paper's).

The task is shaped like an LLM's reasoning where S2T looks (docs/miniature.md): responses of
60-110 tokens whose sentences start at genuinely uncertain positions (several equally likely
phrasings) around near-certain arithmetic, a vocabulary of thousands of tokens the task mostly
never uses, and a warm-up on targets with a small fraction of random tokens, so that a little
probability mass is spread over that long tail and is sampled now and then.

Everything is deterministic (fixed seeds, one torch thread); the build is a few minutes on 2 cores. A rerun with the
same config reuses the folder (the manifest's config hash matches and every file exists); a
different config rebuilds it. The build happens in a temporary sibling folder that replaces
``OUT_DIR`` only when complete, so an interrupted build never leaves a half-written folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: instruction appended to every prompt (as in the real runs; docs/method.md, "Training settings")
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
DATA_SOURCE = "stapo_tiny_addition"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class AssetConfig:
    """Settings of the tiny assets (all defaults give the shipped quickstart assets).

    Problems are ``a + b`` with ``a`` uniform in ``[low, high]`` and ``b`` in ``[b_low, b_high]``.
    The warm-up trains in chunks of ``eval_every`` steps and stops at the first chunk whose sampled
    success rate (temperature 1.0, ``eval_prompts`` val prompts) reaches ``target_success``, or after
    ``max_warmup_steps``.
    """

    seed: int = 0
    low: int = 10
    high: int = 99
    b_low: int = 2
    b_high: int = 9
    n_train: int = 480
    n_val: int = 64
    vocab_size: int = 3072
    filler_words: int = 6000
    filler_sentences: int = 3000
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 256
    warmup_batch_size: int = 24
    warmup_lr: float = 3e-3
    max_warmup_steps: int = 1500
    eval_every: int = 50
    eval_prompts: int = 32
    target_success: float = 0.3
    noise_rate: float = 0.004
    max_new_tokens: int = 160
    tau_p: float = 0.002

    def digest(self) -> str:
        """sha256 (16 hex chars) of the config, the format version and the prompt instruction."""
        blob = json.dumps({"config": dataclasses.asdict(self), "instruction": INSTRUCTION, "version": 1},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class AssetPaths:
    """Where :func:`build_assets` put things (absolute paths)."""

    root: Path
    model: Path
    train: Path
    val: Path
    manifest: Path


def asset_paths(out_dir: str | os.PathLike) -> AssetPaths:
    """Paths of the assets inside ``out_dir`` (whether built or not)."""
    root = Path(out_dir).resolve()
    return AssetPaths(root, root / "model", root / "train.parquet", root / "val.parquet", root / MANIFEST)


# ----------------------------------------------------------------------------------------------
# task
# ----------------------------------------------------------------------------------------------


#: the reasoning templates of a response, one group per sentence slot. Within a slot every phrasing
#: is equally likely, so the model learns genuinely uncertain ("forking") positions where a slot
#: starts, and near-certain positions inside the arithmetic (digits, "=", "+").
OPENERS = (
    "Let's add {a} and {b}.",
    "We need to compute {a} + {b}.",
    "First, write {a} + {b} in columns.",
    "Okay, so we want {a} + {b}.",
    "So the question asks for {a} + {b}.",
    "To find {a} + {b}, add place by place.",
)
ONES = (
    "The ones digits are {x} and {y}: {x} + {y} = {s}.",
    "Ones place: {x} + {y} = {s}.",
    "Start with the ones: {x} + {y} = {s}.",
    "Add the units first: {x} + {y} = {s}.",
)
CARRY = ("Write {d} and carry 1.", "So we write {d}, carrying 1.", "That gives {d} with a carry of 1.")
NO_CARRY = ("Write {d}, no carry.", "No carry, so the ones digit is {d}.", "That is {d}, nothing to carry.")
TENS = ("Then the tens: {x}{c} = {s}.", "Next, the tens: {x}{c} = {s}.", "Now the tens place: {x}{c} = {s}.")
TENS_SAME = ("The tens digit stays {s}.", "Then the tens: still {s}.", "Nothing changes in the tens: {s}.")
CHECKS = ("Wait, let me check: {t} - {b} = {a}. Yes.", "Let me verify: {t} - {b} = {a}, correct.",
          "Check: {a} + {b} = {t}. Good.")
FINALS = (
    "So the sum is {t}. The answer is \\boxed{{{t}}}",
    "Therefore we get {t}, and the answer is \\boxed{{{t}}}",
    "Thus the result is {t}. Final answer: \\boxed{{{t}}}",
    "Hence the total is {t}. \\boxed{{{t}}}",
)
#: probability that a response double-checks its sum before concluding
CHECK_PROB = 0.4


def make_response(a: int, b: int, rng: random.Random) -> str:
    """A worked column addition of ``a + b`` (``a`` two digits, ``b`` one digit), one phrasing per
    slot drawn with ``rng``; it ends with the final answer as ``\\boxed{a + b}`` (nothing after it)."""
    t = a + b
    ones = a % 10 + b
    carry = ones // 10
    tens = a // 10 + carry
    parts = [rng.choice(OPENERS).format(a=a, b=b),
             rng.choice(ONES).format(x=a % 10, y=b, s=ones),
             rng.choice(CARRY if carry else NO_CARRY).format(d=ones % 10),
             rng.choice(TENS).format(x=a // 10, c=" + 1", s=tens) if carry
             else rng.choice(TENS_SAME).format(s=tens)]
    if rng.random() < CHECK_PROB:
        parts.append(rng.choice(CHECKS).format(a=a, b=b, t=t))
    parts.append(rng.choice(FINALS).format(a=a, b=b, t=t))
    return " ".join(parts)


def make_problem(a: int, b: int, rng: random.Random | None = None) -> tuple[str, str, str]:
    """(user prompt, reference response, ground truth) for ``a + b``.

    The response's phrasing is drawn with ``rng`` (default: a generator seeded with ``(a, b)``, so
    the same problem always gets the same reference response)."""
    question = f"What is {a} + {b}?\n\n{INSTRUCTION}"
    response = make_response(a, b, rng if rng is not None else random.Random(a * 1000 + b))
    return question, response, str(a + b)


def filler_words(count: int, seed: int) -> list[str]:
    """``count`` distinct pronounceable pseudo-words (2-3 syllables), drawn with ``seed``.

    They stand for the rest of a language in the tokenizer's training text, so that the vocabulary
    has thousands of tokens the task never uses: the long tail of a real LLM's vocabulary."""
    onsets = "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl pr st tr sh ch th".split()
    vowels = "a e i o u ai ea oo ou".split()
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st"]
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < count:
        syllables = [rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.choice((2, 2, 3)))]
        words.add("".join(syllables) + rng.choice(codas))
    return sorted(words)


def tokenizer_corpus(cfg: "AssetConfig", pairs: list[tuple[int, int]]) -> list[str]:
    """Text the tokenizer is trained on: every problem's prompt and a few phrasings of its response,
    plus ``cfg.filler_sentences`` sentences of :func:`filler_words` (deterministic)."""
    rng = random.Random(cfg.seed + 2)
    corpus = []
    for a, b in pairs:
        question, response, _ = make_problem(a, b)
        corpus += [question, response, make_response(a, b, rng)]
    words = filler_words(cfg.filler_words, cfg.seed + 3)
    for _ in range(cfg.filler_sentences):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))
        corpus.append(sentence[0].upper() + sentence[1:] + rng.choice((".", ".", "?", "!", ",")))
    return corpus


def all_pairs(cfg: AssetConfig) -> list[tuple[int, int]]:
    """Every problem ``(a, b)`` of the configured ranges, in order."""
    return [(a, b) for a in range(cfg.low, cfg.high + 1) for b in range(cfg.b_low, cfg.b_high + 1)]


def make_pairs(cfg: AssetConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint train / val lists of (a, b), drawn with ``cfg.seed``."""
    if cfg.low < 0 or cfg.high < cfg.low:
        raise ValueError(f"AssetConfig: need 0 <= low <= high, got low={cfg.low}, high={cfg.high}")
    if not 0 <= cfg.b_low <= cfg.b_high <= 9:
        raise ValueError(f"AssetConfig: need 0 <= b_low <= b_high <= 9, got b_low={cfg.b_low}, b_high={cfg.b_high}")
    pairs = all_pairs(cfg)
    if cfg.n_train + cfg.n_val > len(pairs):
        raise ValueError(f"AssetConfig: n_train + n_val = {cfg.n_train + cfg.n_val} exceeds the {len(pairs)} "
                         f"distinct problems of a in [{cfg.low}, {cfg.high}], b in [{cfg.b_low}, {cfg.b_high}]")
    rng = random.Random(cfg.seed)
    pairs = rng.sample(pairs, cfg.n_train + cfg.n_val)
    return pairs[: cfg.n_train], pairs[cfg.n_train :]


def _rows(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    rows = []
    for index, (a, b) in enumerate(pairs):
        question, _, truth = make_problem(a, b)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "a": a, "b": b},
        })
    return rows


def write_parquet(pairs: list[tuple[int, int]], split: str, path: Path) -> None:
    """Write one split in verl's RL parquet format."""
    import pandas as pd

    pd.DataFrame(_rows(pairs, split)).to_parquet(path, index=False)


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------


def train_tokenizer(cfg: AssetConfig, corpus: list[str]):
    """Byte-level BPE (digits split individually) trained on ``corpus``; returns a
    ``PreTrainedTokenizerFast`` with the chat template, eos and pad set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def encode_chat(tokenizer, question: str) -> list[int]:
    """Prompt token ids exactly as verl builds them (chat template + generation prompt)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------


def make_model(cfg: AssetConfig, tokenizer):
    """A random-init tiny ``Qwen3ForCausalLM`` (fixed seed, float32, eager attention)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        attn_implementation="eager", torch_dtype="float32",
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def _sft_batch(examples: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded (input_ids, labels) with labels = -100 on prompt and padding. Shapes (B, L) int64."""
    import torch

    width = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (prompt, response) in enumerate(examples):
        seq = prompt + response
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt) : len(seq)] = torch.tensor(response)
    return ids, labels


@dataclass(frozen=True)
class SampleStats:
    """What sampling at temperature 1.0 from the model gives on some problems (one response each).

    ``rare`` counts sampled tokens with p < ``tau_p``; ``rare_in_correct`` those inside responses the
    reward counts as correct: the tokens S2T can flag (its candidates are rare tokens of responses
    with a positive advantage, and in a mixed group exactly the correct responses have one)."""

    success_rate: float
    responses: int
    tokens: int
    mean_length: float
    rare: int
    rare_in_correct: int
    tokens_in_correct: int

    @property
    def rare_per_1k(self) -> float:
        """Rare sampled tokens per 1000 sampled tokens."""
        return 1000.0 * self.rare / max(self.tokens, 1)

    @property
    def candidates_per_1k(self) -> float:
        """Rare tokens of correct responses per 1000 tokens of correct responses."""
        return 1000.0 * self.rare_in_correct / max(self.tokens_in_correct, 1)


def is_correct(text: str, truth: str) -> bool:
    """The training reward's verdict: verl's DAPO rule with ``strict_box_verify`` (the last
    ``\\boxed{}`` within the response's final 100 characters equals ``truth`` exactly)."""
    from verl.utils.reward_score.math_dapo import compute_score

    return compute_score(text, truth, strict_box_verify=True)["score"] > 0


def sample_stats(model, tokenizer, questions: list[str], truths: list[str], cfg: "AssetConfig",
                 seed: int) -> SampleStats:
    """Sample one response per question (temperature 1.0, ``cfg.max_new_tokens``) and count
    successes and rare tokens (p < ``cfg.tau_p``)."""
    import math

    import torch

    from verl_patches.cpu.sampling import sample_batch

    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        samples = sample_batch(model, [encode_chat(tokenizer, q) for q in questions],
                               max_new_tokens=cfg.max_new_tokens, eos_token_ids=[tokenizer.eos_token_id],
                               pad_token_id=tokenizer.pad_token_id, temperature=1.0, generator=gen)
    model.train(was_training)
    log_tau = math.log(cfg.tau_p)
    hits = tokens = rare = rare_ok = tokens_ok = 0
    for sample, truth in zip(samples, truths):
        n_rare = sum(lp < log_tau for lp in sample.log_probs)
        ok = is_correct(tokenizer.decode(sample.token_ids, skip_special_tokens=True), truth)
        hits += ok
        tokens += len(sample.token_ids)
        rare += n_rare
        if ok:
            rare_ok += n_rare
            tokens_ok += len(sample.token_ids)
    return SampleStats(hits / len(questions), len(questions), tokens, tokens / len(questions), rare, rare_ok,
                       tokens_ok)


def response_loss(model, ids, labels):
    """Next-token cross-entropy over the labelled (response) positions only; the same value as
    ``model(input_ids=ids, labels=labels).loss`` without computing the vocabulary softmax at prompt
    and padding positions. ids, labels: (B, L) int64, labels -100 where not trained."""
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    keep = targets != -100
    return F.cross_entropy(model.lm_head(hidden[keep]).float(), targets[keep])


def success_rate(model, tokenizer, questions: list[str], truths: list[str], cfg: "AssetConfig", seed: int) -> float:
    """Fraction of sampled answers (temperature 1.0, one per question) the training reward counts
    as correct (:func:`is_correct`)."""
    return sample_stats(model, tokenizer, questions, truths, cfg, seed).success_rate


def noisy_response(ids: list[int], noise_rate: float, vocab: int, n_special: int, rng: random.Random) -> list[int]:
    """``ids`` with a random ordinary token (id in ``[n_special, vocab)``) inserted before each
    position with probability ``noise_rate``. Trained on as targets, these teach the model a small
    probability mass spread over the whole vocabulary (an LLM's long tail) and to carry on after a
    stray token."""
    out: list[int] = []
    for token in ids:
        if rng.random() < noise_rate:
            out.append(rng.randrange(n_special, vocab))
        out.append(token)
    return out


def warm_up(model, tokenizer, cfg: AssetConfig, sft_pairs, val_pairs) -> tuple[int, float, list[float]]:
    """Supervised warm-up until the sampled success rate reaches ``cfg.target_success``.

    Each step draws ``cfg.warmup_batch_size`` problems of ``sft_pairs`` with a fresh phrasing of
    their response (:func:`make_response`) and noise tokens (:func:`noisy_response`).
    Returns (steps done, final success rate, success rate after each chunk)."""
    import torch
    from tqdm import tqdm

    prompt_ids = {}
    eval_pairs = val_pairs[: cfg.eval_prompts]
    questions = [make_problem(a, b)[0] for a, b in eval_pairs]
    truths = [make_problem(a, b)[2] for a, b in eval_pairs]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed + 1)
    n_special = len(SPECIAL_TOKENS)
    history: list[float] = []
    model.train()
    bar = tqdm(range(1, cfg.max_warmup_steps + 1), desc="tiny-model warm-up", leave=False, mininterval=2.0)
    rate = 0.0
    for step in bar:
        batch = []
        for a, b in rng.sample(sft_pairs, min(cfg.warmup_batch_size, len(sft_pairs))):
            if (a, b) not in prompt_ids:
                prompt_ids[(a, b)] = encode_chat(tokenizer, make_problem(a, b)[0])
            response = tokenizer(make_response(a, b, rng), add_special_tokens=False)["input_ids"]
            response = noisy_response(response, cfg.noise_rate, len(tokenizer), n_special, rng)
            batch.append((prompt_ids[(a, b)], response + [tokenizer.eos_token_id]))
        ids, labels = _sft_batch(batch, tokenizer.pad_token_id)
        loss = response_loss(model, ids, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % cfg.eval_every == 0:
            rate = success_rate(model, tokenizer, questions, truths, cfg, seed=cfg.seed + step)
            history.append(rate)
            bar.set_postfix(loss=f"{loss.item():.3f}", success=f"{rate:.2f}")
            if rate >= cfg.target_success:
                return step, rate, history
    return cfg.max_warmup_steps, rate, history


# ----------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_built(out_dir: str | os.PathLike, cfg: AssetConfig = AssetConfig()) -> bool:
    """True when ``out_dir`` holds complete assets built with ``cfg``."""
    paths = asset_paths(out_dir)
    if not paths.manifest.is_file():
        return False
    try:
        manifest = json.loads(paths.manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    needed = [paths.train, paths.val, paths.model / "config.json", paths.model / "model.safetensors",
              paths.model / "tokenizer.json"]
    return manifest.get("config_hash") == cfg.digest() and all(p.is_file() for p in needed)


def warmup_pairs(cfg: AssetConfig, val_pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Problems the warm-up trains on: every ``(a, b)`` of the range except the validation ones."""
    held_out = set(val_pairs)
    return [pair for pair in all_pairs(cfg) if pair not in held_out]


def _build_into(tmp: Path, cfg: AssetConfig) -> dict:
    import torch

    t0 = time.time()
    train_pairs, val_pairs = make_pairs(cfg)
    tokenizer = train_tokenizer(cfg, tokenizer_corpus(cfg, train_pairs + val_pairs))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and faster than 2 threads on a busy machine
    try:
        model = make_model(cfg, tokenizer)
        steps, rate, history = warm_up(model, tokenizer, cfg, warmup_pairs(cfg, val_pairs), val_pairs)
        questions = [make_problem(a, b)[0] for a, b in val_pairs]
        truths = [make_problem(a, b)[2] for a, b in val_pairs]
        stats = sample_stats(model, tokenizer, questions, truths, cfg, seed=cfg.seed + 7)
    finally:
        torch.set_num_threads(threads)
    paths = asset_paths(tmp)
    model.save_pretrained(paths.model, safe_serialization=True)
    tokenizer.save_pretrained(paths.model)
    write_parquet(train_pairs, "train", paths.train)
    write_parquet(val_pairs, "val", paths.val)
    prompt_tokens = max(len(encode_chat(tokenizer, make_problem(a, b)[0])) for a, b in train_pairs + val_pairs)
    return {
        "config": dataclasses.asdict(cfg),
        "config_hash": cfg.digest(),
        "warmup_steps": steps,
        "success_rate_t1": rate,
        "success_history": history,
        # sampling at temperature 1.0 on the validation problems, one response each
        "sampled": {**dataclasses.asdict(stats), "rare_per_1k": stats.rare_per_1k,
                    "candidates_per_1k": stats.candidates_per_1k, "tau_p": cfg.tau_p},
        "max_prompt_tokens": prompt_tokens,
        "n_params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "build_seconds": round(time.time() - t0, 2),
        "files": {name: _sha256(paths.root / name) for name in ("train.parquet", "val.parquet",
                                                                "model/model.safetensors")},
    }


def build_assets(out_dir: str | os.PathLike, cfg: AssetConfig = AssetConfig(), force: bool = False) -> AssetPaths:
    """Build (or reuse) the tiny assets in ``out_dir``; returns their paths.

    Reuses ``out_dir`` when :func:`is_built` (same config hash, files present) and not ``force``.
    Otherwise builds in a temporary sibling folder and swaps it in atomically (an interrupted build
    leaves the previous folder, if any, untouched).
    """
    paths = asset_paths(out_dir)
    if not force and is_built(paths.root, cfg):
        return paths
    paths.root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{paths.root.name}.tmp-", dir=paths.root.parent))
    try:
        manifest = _build_into(tmp, cfg)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if paths.root.exists():
            old = paths.root.with_name(f".{paths.root.name}.old-{os.getpid()}")
            paths.root.rename(old)
            tmp.rename(paths.root)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(paths.root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return paths


def main(argv: list[str] | None = None, cfg: AssetConfig = AssetConfig()) -> int:
    """CLI entry (``cfg`` is for tests: the CLI always builds the default config)."""
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.cpu.assets", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder to build the assets in (reused when already built)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the folder is up to date")
    args = parser.parse_args(argv)
    reused = not args.force and is_built(args.out_dir, cfg)
    paths = build_assets(args.out_dir, cfg, force=args.force)
    manifest = json.loads(paths.manifest.read_text())
    print(f"[assets] {'reused' if reused else 'built'} {paths.root}: warm-up {manifest['warmup_steps']} steps, "
          f"success rate at T=1.0: {manifest['success_rate_t1']:.2f}, {manifest['n_params']} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
