"""Tiny CPU assets (stapo_cpu.assets and its tiny_* modules) and the batched sampler of their
warm-up check (stapo_cpu.sampling)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import torch

from stapo_cpu.assets import SHIPPED_DIR, AssetConfig, asset_paths, build_assets, is_built, main, verify_assets
from stapo_cpu.tiny_config import INSTRUCTION
from stapo_cpu.tiny_model import make_model
from stapo_cpu.tiny_task import make_pairs, make_problem
from stapo_cpu.tiny_tokenizer import encode_chat, train_tokenizer
from stapo_cpu.sampling import sample_batch

#: a seconds-fast config for the mechanics tests (the default config is built once, below)
QUICK = AssetConfig(n_train=64, n_val=16, max_warmup_steps=20, eval_every=10, eval_prompts=8, target_success=1.1)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def default_assets(assets) -> Path:
    """The shipped default assets (the session's, shared with the e2e tests)."""
    return assets


@pytest.mark.slow
def test_default_assets_succeed_sometimes_but_not_always(default_assets):
    manifest = json.loads((default_assets / "manifest.json").read_text())
    assert manifest["config_hash"] == AssetConfig().digest()
    # GRPO needs mixed outcomes within a group: neither never nor always right at T = 1
    assert 0.2 <= manifest["success_rate_t1"] <= 0.7, manifest["success_history"]
    assert manifest["warmup_steps"] <= AssetConfig().max_warmup_steps
    # the longest prompt fits the CPU path's prompt budget; the sampled responses are long
    assert manifest["max_prompt_tokens"] <= 64
    assert manifest["sampled"]["mean_length"] >= 40


#: rare sampled tokens (p < 0.002 at temperature 1.0) per 1000 sampled tokens that the shipped
#: assets must give on the validation problems with seed 0: enough that a quickstart step of
#: 16 responses x ~80 tokens holds several, few enough that most responses have none
RARE_PER_1K_BAND = (1.0, 40.0)
#: at least this many vocabulary entries (the long tail S2T's candidates come from)
MIN_VOCAB = 2048


@pytest.mark.slow
def test_default_assets_sample_rare_tokens_at_the_papers_tau_p(default_assets):
    """Re-sample the shipped model on the validation problems (fixed seed), score every sampled
    token with a full forward pass (not the sampler's log-probs), and count p < 0.002."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stapo_cpu.tiny_task import is_correct
    from stapo_core.s2t import DEFAULT_TAU_P

    paths = asset_paths(default_assets)
    cfg = AssetConfig()
    tok = AutoTokenizer.from_pretrained(paths.model)
    model = AutoModelForCausalLM.from_pretrained(paths.model, attn_implementation="eager", dtype=torch.float32).eval()
    assert len(tok) >= MIN_VOCAB and cfg.tau_p == DEFAULT_TAU_P == 0.002
    val = pd.read_parquet(paths.val)
    prompts = [encode_chat(tok, row.prompt[0]["content"]) for row in val.itertuples()]
    samples = sample_batch(model, prompts, max_new_tokens=cfg.max_new_tokens, eos_token_ids=[tok.eos_token_id],
                           pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    tokens = rare = rare_in_correct = correct = 0
    lengths = []
    for prompt, sample, row in zip(prompts, samples, val.itertuples()):
        p = _full_forward_log_probs(model, prompt, sample.token_ids).exp()
        ok = is_correct(tok.decode(sample.token_ids, skip_special_tokens=True), row.reward_model["ground_truth"])
        tokens += len(p)
        rare += int((p < DEFAULT_TAU_P).sum())
        rare_in_correct += int((p < DEFAULT_TAU_P).sum()) if ok else 0
        correct += ok
        lengths.append(len(p))
    rate = 1000 * rare / tokens
    assert RARE_PER_1K_BAND[0] <= rate <= RARE_PER_1K_BAND[1], (rate, rare, tokens)
    assert rare_in_correct >= 1  # rare tokens inside rewarded responses: what S2T's candidates are
    assert 0 < correct < len(samples)
    assert 40 <= sum(lengths) / len(lengths) <= cfg.max_new_tokens  # reasoning-length responses


@pytest.mark.slow
def test_default_model_and_tokenizer_load_as_verl_loads_them(default_assets):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    paths = asset_paths(default_assets)
    tok = AutoTokenizer.from_pretrained(paths.model)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.chat_template
    config = AutoConfig.from_pretrained(paths.model)
    assert config.model_type == "qwen3" and config.vocab_size == len(tok) and config.eos_token_id == tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(paths.model)
    assert type(model).__name__ == "Qwen3ForCausalLM" and (paths.model / "model.safetensors").is_file()
    question, response, _ = make_problem(12, 34)
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and question in text
    assert tok.decode(tok(response)["input_ids"]) == response  # byte-level BPE round-trips


@pytest.mark.slow
def test_parquet_is_verl_rl_format_and_rewardable(default_assets):
    from recipe.stapo.reward import compute_score

    paths = asset_paths(default_assets)
    train, val = pd.read_parquet(paths.train), pd.read_parquet(paths.val)
    cfg = AssetConfig()
    assert len(train) == cfg.n_train and len(val) == cfg.n_val
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(train.columns)
    seen = set()
    for frame in (train, val):
        for row in frame.itertuples():
            (message,) = row.prompt
            assert message["role"] == "user" and message["content"].endswith(INSTRUCTION)
            a, b = int(row.extra_info["a"]), int(row.extra_info["b"])
            assert row.reward_model == {"style": "rule", "ground_truth": str(a + b)}
            assert f"What is {a} + {b}?" in message["content"] and (a, b) not in seen
            seen.add((a, b))
            right, wrong = make_problem(a, b)[1], make_problem(a, b + 1)[1]
            assert compute_score(row.data_source, right, row.reward_model["ground_truth"])["score"] == 1.0
            assert compute_score(row.data_source, wrong, row.reward_model["ground_truth"])["score"] == -1.0


@pytest.mark.slow
def test_build_is_deterministic_reused_and_rebuilt_on_config_change(tmp_path):
    one = build_assets(tmp_path / "one", QUICK)
    two = build_assets(tmp_path / "two", QUICK)
    for name in ("train.parquet", "val.parquet", "model/model.safetensors", "model/tokenizer.json"):
        assert _sha(one.root / name) == _sha(two.root / name), name
    recorded = json.loads(one.manifest.read_text())["files"]
    files = sorted(p.relative_to(one.root).as_posix() for p in one.root.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(recorded) == files and {"model/tokenizer.json", "model/config.json", "model/model.safetensors"} <= set(files)
    assert recorded == {name: _sha(one.root / name) for name in files}
    assert verify_assets(one.root, QUICK) == one.root  # a fresh build is a valid set
    stamp = one.manifest.stat().st_mtime_ns
    assert is_built(one.root, QUICK) and build_assets(one.root, QUICK).manifest.stat().st_mtime_ns == stamp
    other = replace(QUICK, seed=1)
    assert not is_built(one.root, other)
    build_assets(one.root, other)
    assert is_built(one.root, other) and not is_built(one.root, QUICK)
    assert _sha(one.root / "train.parquet") != _sha(two.root / "train.parquet")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_shipped_assets_match_their_manifest_and_the_default_config():
    """The shipped set is the default config's build, every file listed with its sha256, nothing else."""
    manifest = json.loads((SHIPPED_DIR / "manifest.json").read_text())
    assert manifest["config_hash"] == AssetConfig().digest() and is_built(SHIPPED_DIR)
    files = sorted(p.relative_to(SHIPPED_DIR).as_posix() for p in SHIPPED_DIR.rglob("*") if p.is_file()
                   and p.name != "manifest.json")
    assert sorted(manifest["files"]) == files and {name: _sha(SHIPPED_DIR / name) for name in files} == manifest["files"]
    assert verify_assets(SHIPPED_DIR) == SHIPPED_DIR
    # vLLM's CPU attention serves only head dimensions of 32 and more
    assert json.loads((SHIPPED_DIR / "model" / "config.json").read_text())["head_dim"] >= 32


def test_the_docs_give_the_shipped_models_parameter_count():
    """One count everywhere: each parameter count docs/miniature.md gives is the shipped model's, counted
    (the tied embedding once), which its manifest records; the CLI prints it without a warning."""
    import re
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    from tests.helpers.paths import REPO

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR / "model")
    count = sum(p.numel() for p in model.parameters())
    assert count == json.loads((SHIPPED_DIR / "manifest.json").read_text())["n_params"] == 319_936
    text = (REPO / "docs" / "miniature.md").read_text()
    given = re.findall(r"([\d,.]+k?)[ -]parameter", text)
    assert len(given) == 3 and set(given) == {f"{count:,}"}, given
    proc = subprocess.run([sys.executable, "-m", "stapo_cpu.assets", str(SHIPPED_DIR)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout == f"[assets] reused {SHIPPED_DIR}: warm-up 500 steps, success rate at T=1.0: 0.59, {count} parameters\n"


def test_verify_assets_names_every_changed_missing_or_extra_file(tmp_path):
    root = build_assets(tmp_path / "set", QUICK).root
    assert verify_assets(root, QUICK) == root
    (root / "val.parquet").write_bytes(b"changed")
    (root / "model" / "tokenizer.json").unlink()
    (root / "model" / "stray.bin").write_bytes(b"x")
    with pytest.raises(ValueError) as err:
        verify_assets(root, QUICK)
    message = str(err.value)
    assert str(root) in message and "val.parquet: sha256" in message
    assert "model/tokenizer.json: missing" in message and "model/stray.bin: not in the manifest" in message
    with pytest.raises(ValueError, match="config hash"):
        verify_assets(root, replace(QUICK, seed=1))
    with pytest.raises(ValueError, match="cannot read"):
        verify_assets(tmp_path / "nothing", QUICK)


def test_the_shipped_folder_is_rebuilt_only_when_forced(tmp_path, monkeypatch):
    import stapo_cpu.assets as assets_module

    shipped = build_assets(tmp_path / "shipped", QUICK).root
    stamp = (shipped / "manifest.json").read_bytes()
    monkeypatch.setattr(assets_module, "SHIPPED_DIR", shipped)
    assert build_assets(shipped, QUICK).root == shipped  # up to date: reused
    with pytest.raises(ValueError, match="--force"):
        build_assets(shipped, replace(QUICK, seed=1))
    assert (shipped / "manifest.json").read_bytes() == stamp  # nothing written
    assert is_built(build_assets(shipped, replace(QUICK, seed=1), force=True).root, replace(QUICK, seed=1))


def test_cli_reuses_a_built_folder(tmp_path, capsys):
    assert main([str(tmp_path / "a")], QUICK) == 0
    assert "built" in capsys.readouterr().out
    assert main([str(tmp_path / "a")], QUICK) == 0
    assert "reused" in capsys.readouterr().out


def test_pairs_are_disjoint_and_invalid_config_is_named():
    train, val = make_pairs(QUICK)
    assert len(set(train)) == QUICK.n_train and not set(train) & set(val)
    with pytest.raises(ValueError, match="exceeds"):
        make_pairs(replace(QUICK, low=1, high=3))
    with pytest.raises(ValueError, match="low <= high"):
        make_pairs(replace(QUICK, low=5, high=4))


# ------------------------------------------------------------------------------------------------
# sampler
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    train, val = make_pairs(QUICK)
    tok = train_tokenizer(QUICK, [t for a, b in train + val for t in make_problem(a, b)[:2]])
    model = make_model(QUICK, tok).eval()
    return model, tok


def _full_forward_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_sampled_log_probs_equal_a_full_forward_pass_despite_left_padding(tiny):
    model, tok = tiny
    prompts = [encode_chat(tok, make_problem(a, b)[0]) for a, b in [(10, 20), (33, 44)]] + [[5, 6]]
    samples = sample_batch(model, prompts, max_new_tokens=6, eos_token_ids=[tok.eos_token_id],
                           pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0))
    for prompt, sample in zip(prompts, samples):
        assert len(sample.token_ids) == len(sample.log_probs) >= 1
        assert sample.stop_reason == ("completed" if sample.token_ids[-1] == tok.eos_token_id else "length")
        torch.testing.assert_close(torch.tensor(sample.log_probs), _full_forward_log_probs(model, prompt, sample.token_ids),
                                   atol=1e-4, rtol=1e-4)


def test_temperature_scales_the_reported_log_probs(tiny):
    model, tok = tiny
    prompt = [5, 6, 7]
    sample = sample_batch(model, [prompt], max_new_tokens=3, eos_token_ids=[tok.eos_token_id],
                          pad_token_id=tok.pad_token_id, temperature=0.5, generator=torch.Generator().manual_seed(1))[0]
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / 0.5
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(sample.log_probs), ref, atol=1e-4, rtol=1e-4)


def test_seeded_sampling_is_reproducible(tiny):
    model, tok = tiny
    kwargs = dict(max_new_tokens=5, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    a = sample_batch(model, [[5, 6], [7]], generator=torch.Generator().manual_seed(9), **kwargs)
    b = sample_batch(model, [[5, 6], [7]], generator=torch.Generator().manual_seed(9), **kwargs)
    assert a == b


@pytest.mark.parametrize("kwargs,match", [
    ({"prompts": []}, "empty"),
    ({"prompts": [[1], []]}, "empty prompt"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"temperature": 0.0}, "temperature"),
])
def test_sampler_rejects_bad_arguments(tiny, kwargs, match):
    model, tok = tiny
    args = dict(prompts=[[1, 2]], max_new_tokens=2, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sample_batch(model, args.pop("prompts"), **args)


# ------------------------------------------------------------------------------------------------
# the task's text and the warm-up's pieces (fast)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a,b", [(10, 2), (47, 5), (95, 9), (99, 9), (30, 7)])
def test_every_phrasing_is_right_and_ends_with_the_boxed_answer(a, b):
    """Every sampled phrasing passes the strict DAPO check (last \\boxed{} in the final 100 chars,
    exact integer string) and its arithmetic lines are true."""
    import random
    import re

    from stapo_cpu.tiny_task import is_correct, make_response

    seen = set()
    for seed in range(40):
        text = make_response(a, b, random.Random(seed))
        seen.add(text)
        assert text.endswith(f"\\boxed{{{a + b}}}") and is_correct(text, str(a + b))
        assert not is_correct(text, str(a + b + 1))
        for x, y, s in re.findall(r"(\d+) \+ (\d+) = (\d+)", text):
            assert int(x) + int(y) == int(s), text
        for x, y, z, s in re.findall(r"(\d+) \+ (\d+) \+ (\d+) = (\d+)", text):
            assert int(x) + int(y) + int(z) == int(s), text
    assert len(seen) >= 20  # many phrasings of one problem: the forking positions
    assert make_problem(a, b)[1] == make_problem(a, b)[1]  # the reference phrasing is fixed


def test_noise_tokens_are_ordinary_and_at_the_configured_rate():
    import random

    from stapo_cpu.tiny_model import noisy_response

    ids = list(range(100, 130)) * 400
    out = noisy_response(ids, 0.01, vocab=3000, n_special=3, rng=random.Random(0))
    inserted = len(out) - len(ids)
    assert 0.007 * len(ids) <= inserted <= 0.013 * len(ids)  # binomial(12000, 0.01): mean 120, sd 11
    it = iter(out)
    assert all(token in it for token in ids)  # the original ids stay in order
    assert all(3 <= t < 3000 for t in out)
    assert noisy_response(ids, 0.0, 3000, 3, random.Random(0)) == ids


def test_response_loss_equals_the_models_loss(tiny):
    import random

    from stapo_cpu.tiny_model import _sft_batch, response_loss
    from stapo_cpu.tiny_task import make_response

    model, tok = tiny
    rng = random.Random(0)
    batch = [(encode_chat(tok, make_problem(a, b)[0]),
              tok(make_response(a, b, rng))["input_ids"] + [tok.eos_token_id]) for a, b in [(12, 3), (45, 9), (70, 2)]]
    ids, labels = _sft_batch(batch, tok.pad_token_id)
    with torch.no_grad():
        torch.testing.assert_close(response_loss(model, ids, labels), model(input_ids=ids, labels=labels).loss,
                                   atol=1e-5, rtol=1e-5)


def test_tokenizer_has_a_large_vocabulary_and_short_prompts():
    """Trained on the build's corpus (task text + filler), the vocabulary is full-size; the task
    itself uses a small part of it and its prompts stay within the CPU path's 64 tokens."""
    from stapo_cpu.tiny_tokenizer import tokenizer_corpus

    train, val = make_pairs(QUICK)
    tok = train_tokenizer(QUICK, tokenizer_corpus(QUICK, train + val))
    assert len(tok) == QUICK.vocab_size >= 2048
    assert len(encode_chat(tok, make_problem(99, 9)[0])) <= 64
    used = {i for a, b in train for i in tok(make_problem(a, b)[1])["input_ids"]}
    assert len(used) < len(tok) / 4  # most of the vocabulary is the tail the task never uses
