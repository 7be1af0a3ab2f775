"""The tiny assets' tokenizer: a byte-level BPE trained on the task text plus filler text of pseudo-words
(:func:`filler_words`), the long tail of vocabulary the task never uses, where S2T's rare tokens come
from (docs/miniature.md); with a Qwen-style chat template, and :func:`encode_chat` building prompt ids as
verl does.
"""

from __future__ import annotations

import random

from .tiny_config import AssetConfig
from .tiny_task import make_problem, make_response

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def filler_words(count: int, seed: int) -> list[str]:
    """``count`` distinct pronounceable pseudo-words (2-3 syllables), drawn with ``seed``."""
    onsets = "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl pr st tr sh ch th".split()
    vowels = "a e i o u ai ea oo ou".split()
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st"]
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < count:
        syllables = [rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.choice((2, 2, 3)))]
        words.add("".join(syllables) + rng.choice(codas))
    return sorted(words)


def tokenizer_corpus(cfg: AssetConfig, pairs: list[tuple[int, int]]) -> list[str]:
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


def train_tokenizer(cfg: AssetConfig, corpus: list[str]):
    """Byte-level BPE (digits split individually) trained on ``corpus``; returns a
    ``PreTrainedTokenizerFast`` with the chat template, eos and pad set."""
    # tokenizers and transformers (seconds) only when the tokenizer is trained
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
