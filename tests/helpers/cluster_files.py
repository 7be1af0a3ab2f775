"""A stand-in for a cluster's shared storage: data files, model folders and a checkpoint root laid
out as the paper runs expect them (``STAPO_DATA_DIR``, ``STAPO_MODEL_DIR``, ``CKPT_DIR``), small
enough for a test. The model folders carry the real ``config.json`` of the paper's Qwen3 base models
(as published with them), the tiny tokenizer the CPU path ships (a real one with a chat template: the
preflight loads it as verl does and runs verl's dataset with it on the data files' first rows) and a
stand-in weights file (the preflight checks that it exists)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stapo_cpu.assets import SHIPPED_DIR

#: the shipped tiny model's tokenizer files (a Qwen-style chat template)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _qwen3(hidden: int, layers: int, heads: int, intermediate: int, tied: bool) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": intermediate,
            "max_position_embeddings": 32768, "num_attention_heads": heads, "num_hidden_layers": layers,
            "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": tied,
            "torch_dtype": "bfloat16", "vocab_size": 151936}


#: the published config.json of each paper model (the fields the memory model reads, and a few more)
QWEN3_CONFIGS = {
    "Qwen3-1.7B-Base": _qwen3(2048, 28, 16, 6144, True),
    "Qwen3-8B-Base": _qwen3(4096, 36, 32, 12288, False),
    "Qwen3-14B-Base": _qwen3(5120, 40, 40, 17408, False),
}


#: rows of a stand-in data file: one batch of the paper's runs (``data.train_batch_size``), the fewest
#: prompts the preflight accepts as a training set
PAPER_BATCH = 256


def write_dataset(path: Path, rows: int = PAPER_BATCH, drop: tuple[str, ...] = ()) -> Path:
    """A parquet file in verl's RL format (what ``recipe.stapo.data.prepare`` writes), minus ``drop``."""
    table = {
        "data_source": ["math_dapo"] * rows,
        "prompt": [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(rows)],
        "ability": ["math"] * rows,
        "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(rows)],
        "extra_info": [{"index": i, "id": str(i), "split": "train"} for i in range(rows)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({k: v for k, v in table.items() if k not in drop}), path)
    return path


def write_model(folder: Path, config: dict, tokenizer: bool = True, weights: bool = True) -> Path:
    """A model folder: ``config.json``, the shipped tiny tokenizer and a stand-in weights file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer:
        for name in TOKENIZER_FILES:
            shutil.copy(SHIPPED_DIR / "model" / name, folder / name)
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


def fake_cluster(root: Path) -> dict[str, str]:
    """Data, models and a checkpoint root under ``root``; returns the environment pointing at them."""
    data, models, ckpt = root / "data", root / "models", root / "checkpoints"
    write_dataset(data / "train.parquet")
    write_dataset(data / "aime24_val.parquet", rows=2)
    for name, config in QWEN3_CONFIGS.items():
        write_model(models / name, config)
    ckpt.mkdir(parents=True, exist_ok=True)
    return {"STAPO_DATA_DIR": str(data), "STAPO_MODEL_DIR": str(models), "CKPT_DIR": str(ckpt)}


def use_fake_cluster(root: Path, monkeypatch) -> dict[str, Path]:
    """:func:`fake_cluster` under ``root``, its variables set (and ``GPU_MEM_GB`` / ``LAUNCH`` unset)
    through pytest's ``monkeypatch``; returns the folders (``root``, ``data``, ``models``, ``ckpt``)."""
    env = fake_cluster(root)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("GPU_MEM_GB", "LAUNCH"):
        monkeypatch.delenv(key, raising=False)
    return {"root": root, "data": Path(env["STAPO_DATA_DIR"]), "models": Path(env["STAPO_MODEL_DIR"]),
            "ckpt": Path(env["CKPT_DIR"])}
