"""Tiny offline assets for the CPU path: tokenizer, synthetic math task, warmed-up tiny Qwen3.

CLI::

    python -m recipe.stapo.cpu.assets OUT_DIR [--force]

Writes into ``OUT_DIR``:

- ``model/``: a ``Qwen3ForCausalLM`` (random init with a fixed seed, then a short supervised
  warm-up on the task) saved with ``save_pretrained`` (safetensors), together with its tokenizer
  (a byte-level BPE trained locally, ``PreTrainedTokenizerFast`` with a Qwen-style
  ``chat_template``, eos ``<|im_end|>``, pad ``<|endoftext|>``). verl loads both from this folder.
- ``train.parquet``, ``val.parquet``: addition problems in verl's RL format (``data_source``,
  ``prompt`` = [{"role": "user", "content": ...}], ``ability``, ``reward_model`` =
  {"style": "rule", "ground_truth": ...}, ``extra_info``); every prompt ends with the instruction
  of the real runs. The answer goes in ``\\boxed{}``.
- ``manifest.json``: the config, its hash, file hashes, the warm-up steps and the measured
  sampling success rate at temperature 1.0 (target 20-70%, so GRPO advantages are non-zero).

Everything is deterministic (fixed seeds, single-threaded-safe) and takes seconds. A rerun with the
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

#: instruction appended to every prompt (as in the real runs; STAPO_SPEC.md section 5)
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

    Problems are ``a + b`` with ``a, b`` uniform in ``[low, high]``.
    The warm-up trains in chunks of ``eval_every`` steps and stops at the first chunk whose sampled
    success rate (temperature 1.0, ``eval_prompts`` val prompts) reaches ``target_success``, or after
    ``max_warmup_steps``.
    """

    seed: int = 0
    low: int = 10
    high: int = 99
    n_train: int = 512
    n_val: int = 64
    vocab_size: int = 400
    hidden_size: int = 64
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    max_position_embeddings: int = 256
    warmup_batch_size: int = 64
    warmup_lr: float = 3e-3
    max_warmup_steps: int = 800
    eval_every: int = 25
    eval_prompts: int = 64
    target_success: float = 0.4
    max_new_tokens: int = 32

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


def make_problem(a: int, b: int) -> tuple[str, str, str]:
    """(user prompt, reference response, ground truth) for ``a + b``."""
    question = f"What is {a} + {b}?\n\n{INSTRUCTION}"
    response = f"{a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}."
    return question, response, str(a + b)


def make_pairs(cfg: AssetConfig) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Disjoint train / val lists of (a, b), drawn with ``cfg.seed``."""
    span = cfg.high - cfg.low + 1
    if cfg.low < 0 or span < 1:
        raise ValueError(f"AssetConfig: need 0 <= low <= high, got low={cfg.low}, high={cfg.high}")
    if cfg.n_train + cfg.n_val > span * span:
        raise ValueError(f"AssetConfig: n_train + n_val = {cfg.n_train + cfg.n_val} exceeds the {span * span} "
                         f"distinct problems of [{cfg.low}, {cfg.high}]")
    rng = random.Random(cfg.seed)
    pairs = rng.sample([(a, b) for a in range(cfg.low, cfg.high + 1) for b in range(cfg.low, cfg.high + 1)],
                       cfg.n_train + cfg.n_val)
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


def success_rate(model, tokenizer, questions: list[str], truths: list[str], cfg: AssetConfig, seed: int) -> float:
    """Fraction of sampled answers (temperature 1.0, one per question) whose last ``\\boxed{}``
    equals the ground truth. A plain check used only to stop the warm-up."""
    import torch

    from verl_patches.cpu.sampling import sample_batch

    model.eval()
    gen = torch.Generator().manual_seed(seed)
    samples = sample_batch(model, [encode_chat(tokenizer, q) for q in questions], max_new_tokens=cfg.max_new_tokens,
                           eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
                           temperature=1.0, generator=gen)
    model.train()
    hits = sum(_last_boxed(tokenizer.decode(s.token_ids, skip_special_tokens=True)) == t
               for s, t in zip(samples, truths))
    return hits / len(questions)


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = text.find("}", start)
    return text[start + len("\\boxed{") : end].strip() if end >= 0 else None


def warm_up(model, tokenizer, cfg: AssetConfig, train_pairs, val_pairs) -> tuple[int, float, list[float]]:
    """Supervised warm-up until the sampled success rate reaches ``cfg.target_success``.

    Returns (steps done, final success rate, success rate after each chunk)."""
    import torch
    from tqdm import tqdm

    examples = []
    for a, b in train_pairs:
        question, response, _ = make_problem(a, b)
        examples.append((encode_chat(tokenizer, question),
                         tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]))
    eval_pairs = val_pairs[: cfg.eval_prompts]
    questions = [make_problem(a, b)[0] for a, b in eval_pairs]
    truths = [make_problem(a, b)[2] for a, b in eval_pairs]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warmup_lr, weight_decay=0.0)
    rng = random.Random(cfg.seed + 1)
    history: list[float] = []
    model.train()
    bar = tqdm(range(1, cfg.max_warmup_steps + 1), desc="tiny-model warm-up", leave=False, mininterval=2.0)
    rate = 0.0
    for step in bar:
        ids, labels = _sft_batch(rng.sample(examples, min(cfg.warmup_batch_size, len(examples))),
                                 tokenizer.pad_token_id)
        loss = model(input_ids=ids, labels=labels).loss
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


def _build_into(tmp: Path, cfg: AssetConfig) -> dict:
    import torch

    t0 = time.time()
    train_pairs, val_pairs = make_pairs(cfg)
    corpus = [text for a, b in train_pairs + val_pairs for text in make_problem(a, b)[:2]]
    tokenizer = train_tokenizer(cfg, corpus)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 2))
    try:
        model = make_model(cfg, tokenizer)
        steps, rate, history = warm_up(model, tokenizer, cfg, train_pairs, val_pairs)
    finally:
        torch.set_num_threads(threads)
    paths = asset_paths(tmp)
    model.save_pretrained(paths.model, safe_serialization=True)
    tokenizer.save_pretrained(paths.model)
    write_parquet(train_pairs, "train", paths.train)
    write_parquet(val_pairs, "val", paths.val)
    return {
        "config": dataclasses.asdict(cfg),
        "config_hash": cfg.digest(),
        "warmup_steps": steps,
        "success_rate_t1": rate,
        "success_history": history,
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
