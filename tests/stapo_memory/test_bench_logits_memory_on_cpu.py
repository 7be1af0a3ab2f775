"""The memory model's logits-side numbers against a measurement (stapo_memory/bench_logits_memory.py):
Qwen3's 151,936-token vocabulary, 2,560 tokens of bfloat16 logits, the peak resident memory each
computation adds, in a fresh process. verl's unchunked sum of squared probabilities (with CUDA
autocast's float32 logsumexp), the recipe's chunked one and verl's chunked entropy (512-row chunks, so
that chunking shows), the logits themselves and verl's log-probs. About a minute of CPU and 5 GB of
memory: marked slow."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow

MIB = 1024**2
TOKENS, VOCAB, CHUNK = 2560, 151936, 512


def test_logits_side_peak_memory_matches_the_model(tmp_path):
    """The command docs/memory.md shows for its second table, as written (its rows also to a file)."""
    (command,) = re.findall(rf"^python -m stapo_memory\.bench_logits_memory --tokens {TOKENS} --chunk {CHUNK}(?= )",
                            (REPO / "docs" / "memory.md").read_text(), re.M)
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, *shlex.split(command)[1:], "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    assert {(r["tokens"], r["vocab"]) for r in rows.values()} == {(TOKENS, VOCAB)}
    assert set(rows) == {"logits", "sum_pi_squared_verl", "sum_pi_squared_chunked", "entropy_chunked", "log_probs"}
    for case, row in rows.items():
        if case == "log_probs":  # a few KiB per token at most: below the measurement's resolution
            assert row["measured_bytes"] < 16 * MIB, row
        else:
            assert 0.95 <= row["ratio"] <= 1.05, row
    # about 10 bytes per logit unchunked; the chunked one is bounded by its chunk, not the tokens
    assert rows["sum_pi_squared_verl"]["measured_bytes"] > 9.5 * TOKENS * VOCAB
    assert rows["sum_pi_squared_chunked"]["measured_bytes"] < 12.5 * CHUNK * VOCAB


def test_the_command_names_itself():
    proc = subprocess.run([sys.executable, "-m", "stapo_memory.bench_logits_memory", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m stapo_memory.bench_logits_memory ")
