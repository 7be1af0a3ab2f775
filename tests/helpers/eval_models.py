"""Shared pieces of the evaluation tests: tiny local models (a random policy, judges that always answer
one letter; heads of 32, the smallest vLLM's CPU attention takes), benchmark folders built from the
fixtures, a scripted generation backend, and what a vLLM engine uses (its processes, its
shared-memory segments)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from recipe.stapo.data import prepare
from recipe.stapo.eval import run_eval
from recipe.stapo.eval.backends import Completion, GenerationBackend
from recipe.stapo.eval.run_eval import EvalConfig

FIXTURES = Path(prepare.__file__).parent / "fixtures"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer():
    """A byte-level BPE tokenizer trained on the fixtures, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = [(FIXTURES / n).read_text() for n in ("bench_sample.jsonl", "dapo_sample.jsonl")] + [prepare.PROMPT_SUFFIX]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def _config(tokenizer, positions: int, tied: bool):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=positions,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=tied,
    )


def build_tiny_model(out_dir: Path) -> Path:
    """The tokenizer and a random 1-layer Qwen3 (seed 0), saved."""
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_config(tokenizer, 512, True))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_judge_model(out_dir: Path, letter: str, positions: int = 8192) -> Path:
    """A 1-layer Qwen3 whose greedy output is always ``letter`` then end-of-sequence.

    Its attention and MLP outputs are zero, so the residual stream at a position is the embedding
    of that position's token: every token embeds to e0 except ``letter``, which embeds to e1; the
    output head maps e0 to ``letter`` and e1 to the end token (all other logits 0).
    """
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tokenizer()
    letter_id, eos = tokenizer.convert_tokens_to_ids(letter), tokenizer.eos_token_id
    assert tokenizer.decode([letter_id]) == letter
    model = Qwen3ForCausalLM(_config(tokenizer, positions, False))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 0] = 1.0
        embed[letter_id] = 0.0
        embed[letter_id, 1] = 1.0
        head = model.lm_head.weight
        head.zero_()
        head[letter_id, 0] = 1.0
        head[eos, 1] = 1.0
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


class ScriptedBackend(GenerationBackend):
    """Answers correctly exactly when ``seed % 3 == 0`` (seeds are known in advance), else "-1"."""

    def __init__(self, answers, pad=""):
        self.answers, self.tokenizer, self.pad = answers, None, pad

    def render(self, messages):
        return messages[-1]["content"]

    def generate(self, prompts, seeds, sampling):
        out = []
        for prompt, seed in zip(prompts, seeds):
            answer = self.answers[prompt] if seed % 3 == 0 else "-1"
            out.append(Completion(f"{self.pad}reasoning... \\boxed{{{answer}}}", 5, "stop"))
        return out


def fixture_rows():
    """The source rows of ``bench_sample.jsonl`` (5 problems, ids b1..b5)."""
    return [json.loads(line) for line in (FIXTURES / "bench_sample.jsonl").read_text().splitlines() if line.strip()]


def bench_dir(root, rows, names=("aime24",), manifest=False):
    """Prepared benchmark folder built from ``rows`` (source-dataset dicts) for each name."""
    root.mkdir(parents=True, exist_ok=True)
    source = root / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in names:
        prepare.prepare_dataset(prepare.BENCHMARK_SPECS[name], root / f"{name}.parquet", str(source),
                                manifest_dir=root if manifest else None)
    return root


class CountingScripted(ScriptedBackend):
    """ScriptedBackend that counts the completions it is asked for."""

    def __init__(self, answers, pad=""):
        super().__init__(answers, pad)
        self.calls = 0

    def generate(self, prompts, seeds, sampling):
        self.calls += len(prompts)
        return super().generate(prompts, seeds, sampling)


def answers(bench_dir, name="aime24"):
    return {p.messages[-1]["content"]: p.ground_truth for p in run_eval.load_problems(Path(bench_dir) / f"{name}.parquet")}


def scripted_config(bench_dir, out, **overrides):
    values = dict(
        model="scripted", benchmarks_dir=str(bench_dir), out=str(out), benchmarks=("aime24",),
        n_samples={"aime24": 6}, max_new_tokens=6, backend="hf", batch_size=4, seed=7, decodings=("train",),
        verifier="none",
    )
    values.update(overrides)
    return EvalConfig(**values)


def engine_processes(pid: int) -> list:
    """The live vLLM engine processes (``VLLM::EngineCore``, ``VLLM::Worker``...) among the descendants
    of process ``pid``, as psutil processes."""
    import psutil

    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and " ".join(child.cmdline()).startswith("VLLM::"):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def mapped_segments(pids) -> set[str]:
    """Names of the ``/dev/shm`` segments the processes ``pids`` have mapped (vLLM's message queues)."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # ended meanwhile
            continue
        names.update(line.split("/dev/shm/", 1)[1].split(" ")[0] for line in maps.splitlines() if "/dev/shm/" in line)
    return names


def outliving(sid: int, grace_s: float = 30.0) -> list[str]:
    """Command lines of the processes of session ``sid`` still running ``grace_s`` seconds on (an
    engine's worker ends a few seconds after its engine core, on its own)."""
    import psutil

    members = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid:
                members.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    _, alive = psutil.wait_procs(members, timeout=grace_s)
    names = []
    for process in alive:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                names.append(" ".join(process.cmdline())[:200])
        except psutil.NoSuchProcess:
            continue
    return names


class SessionSegments:
    """Collects the ``/dev/shm`` segments the processes of session ``sid`` map, sampled every
    ``interval_s`` seconds in a thread from :meth:`start` to :meth:`stop` (what a run used, told
    apart from the segments of other programs running meanwhile)."""

    def __init__(self, sid: int, interval_s: float = 0.5):
        import threading

        self.sid, self.interval_s, self.seen = sid, interval_s, set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _members(self) -> list[int]:
        members = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.getsid(int(name)) == self.sid:
                        members.append(int(name))
                except OSError:
                    continue
        return members

    def _watch(self) -> None:
        while not self._done.wait(self.interval_s):
            self.seen |= mapped_segments(self._members())

    def start(self) -> "SessionSegments":
        self._thread.start()
        return self

    def stop(self) -> set[str]:
        self._done.set()
        self._thread.join()
        return self.seen
