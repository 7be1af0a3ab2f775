"""Tiny offline assets for the CPU path: tokenizer, synthetic math task, warmed-up tiny Qwen3
(docs/miniature.md: what they are, the shipped set :data:`SHIPPED_DIR` and how to regenerate it).

CLI: ``python -m stapo_cpu.assets OUT_DIR [--force]``, run with the math libraries held to AVX2
(:func:`stapo_cpu.isa.isa_env`) as every CPU training run is. Writes into ``OUT_DIR`` the folders and
files of :class:`AssetPaths` and ``manifest.json`` (the config, its hash, the sha256 of every other
file, the warm-up and sampling statistics). :mod:`.tiny_task`, :mod:`.tiny_tokenizer` and
:mod:`.tiny_model` build the task, tokenizer and model; this module holds the folder layout, the
reuse check (:func:`build_assets`) and the CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from stapo_core.fileio import atomic_write, sha256_file

from .isa import isa_env
from .tiny_config import AssetConfig
from .tiny_model import make_model, sample_stats, warm_up, warmup_pairs
from .tiny_task import make_pairs, make_problem, write_parquet
from .tiny_tokenizer import encode_chat, tokenizer_corpus, train_tokenizer

#: what other modules import from here: the build and its settings, and the builder steps the
#: sampler tests assemble a small model from
__all__ = ["AssetConfig", "AssetPaths", "MANIFEST", "SHIPPED_DIR", "asset_paths", "build_assets", "file_hashes",
           "is_built", "main", "make_model", "make_pairs", "make_problem", "train_tokenizer", "verify_assets"]

MANIFEST = "manifest.json"
#: the built set the repository ships (the default everywhere a CPU run needs assets)
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped_assets"


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


def is_built(out_dir: str | os.PathLike, cfg: AssetConfig = AssetConfig()) -> bool:
    """True when ``out_dir`` holds complete assets built with ``cfg``."""
    paths = asset_paths(out_dir)
    if not os.path.isfile(paths.manifest):  # False, never an OSError, for a name too long
        return False
    try:
        manifest = json.loads(paths.manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    needed = [paths.train, paths.val, paths.model / "config.json", paths.model / "model.safetensors",
              paths.model / "tokenizer.json"]
    return manifest.get("config_hash") == cfg.digest() and all(p.is_file() for p in needed)


def file_hashes(out_dir: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file of an asset folder but the manifest, by path relative to it (sorted)."""
    root = Path(out_dir)
    return {path.relative_to(root).as_posix(): sha256_file(path)
            for path in sorted(root.rglob("*")) if path.is_file() and path.name != MANIFEST}


def verify_assets(out_dir: str | os.PathLike, cfg: AssetConfig = AssetConfig()) -> Path:
    """Check that ``out_dir`` holds exactly the files its manifest lists, with their sha256, built
    with ``cfg``; returns the folder. Raises ValueError naming the folder and every file that is
    missing, extra or changed (or the config hash that differs)."""
    paths = asset_paths(out_dir)
    try:
        manifest = json.loads(paths.manifest.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"verify_assets: cannot read {paths.manifest} ({exc})") from exc
    problems = []
    if manifest.get("config_hash") != cfg.digest():
        problems.append(f"config hash {manifest.get('config_hash')} in the manifest, {cfg.digest()} in AssetConfig "
                        f"(regenerate: python -m stapo_cpu.assets {paths.root} --force)")
    listed, found = manifest.get("files") or {}, file_hashes(paths.root)
    problems += [f"{name}: missing" for name in sorted(set(listed) - set(found))]
    problems += [f"{name}: not in the manifest" for name in sorted(set(found) - set(listed))]
    problems += [f"{name}: sha256 {found[name][:12]}... but the manifest says {listed[name][:12]}..."
                 for name in sorted(set(listed) & set(found)) if listed[name] != found[name]]
    if problems:
        raise ValueError(f"verify_assets: {paths.root} does not match its manifest:\n  " + "\n  ".join(problems))
    return paths.root


def _build_into(tmp: Path, cfg: AssetConfig) -> dict:
    """Build every asset into ``tmp`` (task split, tokenizer, warmed-up model, parquet files);
    returns the manifest."""
    # torch (seconds) only when assets are built, not for --help or a check of the manifest
    import torch

    t0 = time.time()
    train_pairs, val_pairs = make_pairs(cfg)
    tokenizer = train_tokenizer(cfg, tokenizer_corpus(cfg, train_pairs + val_pairs))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and faster than 2 threads on a busy machine
    try:
        model = make_model(cfg, tokenizer)
        steps, rate, history = warm_up(model, tokenizer, cfg, warmup_pairs(cfg, val_pairs), val_pairs)
        stats = sample_stats(model, tokenizer, val_pairs, cfg, seed=cfg.seed + 7)
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
        "files": file_hashes(paths.root),
    }


def build_assets(out_dir: str | os.PathLike, cfg: AssetConfig = AssetConfig(), force: bool = False) -> AssetPaths:
    """Build (or reuse) the tiny assets in ``out_dir``; returns their paths.

    Reuses ``out_dir`` when :func:`is_built` (same config hash, files present) and not ``force``.
    Otherwise builds in a temporary sibling folder and swaps it in atomically (an interrupted build
    leaves the previous folder, if any, untouched). The shipped set (:data:`SHIPPED_DIR`) is rebuilt
    only with ``force``: without it, a shipped set that does not match ``cfg`` raises ValueError.
    """
    paths = asset_paths(out_dir)
    if not force and is_built(paths.root, cfg):
        return paths
    if not force and paths.root == SHIPPED_DIR:
        raise ValueError(f"build_assets: the shipped assets in {paths.root} were not built with this AssetConfig "
                         f"(config hash {cfg.digest()}); regenerate them with "
                         f"`python -m stapo_cpu.assets {paths.root} --force` or give another folder")
    paths.root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{paths.root.name}.tmp-", dir=paths.root.parent))
    try:
        manifest = _build_into(tmp, cfg)
        atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
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
    parser = argparse.ArgumentParser(prog="python -m stapo_cpu.assets", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="folder to build the assets in (reused when already built)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the folder is up to date")
    args = parser.parse_args(argv)
    reused = not args.force and is_built(args.out_dir, cfg)
    paths = build_assets(args.out_dir, cfg, force=args.force)
    manifest = json.loads(paths.manifest.read_text())
    print(f"[assets] {'reused' if reused else 'built'} {paths.root}: warm-up {manifest['warmup_steps']} steps, "
          f"success rate at T=1.0: {manifest['success_rate_t1']:.2f}, {manifest['n_params']} parameters")
    return 0


def _exec_pinned() -> None:
    """Restart this command with the math libraries held to AVX2 unless they already are (the
    settings are read when torch loads, so they cannot be changed in a running process)."""
    pin = isa_env()
    if any(os.environ.get(key) != value for key, value in pin.items()):
        os.execve(sys.executable, [sys.executable, "-m", "stapo_cpu.assets", *sys.argv[1:]],
                  {**os.environ, **pin})


if __name__ == "__main__":
    if not {"-h", "--help"} & set(sys.argv[1:]):  # the help computes nothing: no restart under the pin
        _exec_pinned()
    sys.exit(main())
