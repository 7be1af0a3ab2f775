"""LLM answer verifiers that re-check the rule-based grader's failures (docs/eval.md).

The paper re-checks rule-based failures with CompassVerifier-3B. :class:`AnswerVerifier` is the
interface (any model or service can plug in); :class:`CompassVerifier` is the vLLM
implementation (GPU only; vllm is imported lazily). The default prompt asks for the verifier's
"A" (correct) / "B" (incorrect) / "C" (invalid) judgement; for paper-faithful grading pass the
official CompassVerifier prompt (``src/prompts.py`` of open-compass/CompassVerifier, the
non-CoT one) with ``--verifier-prompt-file``: it must contain ``{question}``, ``{gold_answer}``
and ``{llm_response}``.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

DEFAULT_COMPASS_MODEL = "opencompass/CompassVerifier-3B"
RESPONSE_TAIL_CHARS = 4000
"""Only the end of a response is shown to the verifier (the final answer lives there)."""

DEFAULT_PROMPT = (
    "You are grading a candidate's answer against a standard answer, which is always correct.\n"
    "Compare only the FINAL answer; ignore the reasoning and any \\boxed{{}} wrapper; equivalent "
    "forms (fractions vs decimals, reordered expressions, units) count as the same answer.\n"
    "Reply with one letter: A if the candidate is CORRECT, B if INCORRECT, C if INVALID "
    "(cut off, repetitive, or no answer).\n"
    "<Original Question Begin>:\n{question}\n<Original Question End>\n"
    "<Standard Answer Begin>:\n{gold_answer}\n<Standard Answer End>\n"
    "<Candidate's Answer Begin>:\n{llm_response}\n<Candidate's Answer End>\n"
    "Judging the correctness of the candidate's answer:\n"
)
_REQUIRED_FIELDS = ("{question}", "{gold_answer}", "{llm_response}")


@dataclass(frozen=True)
class VerifyItem:
    """One (question, reference, response) triple to judge."""

    question: str
    gold_answer: str
    response: str


class AnswerVerifier(ABC):
    """Judges whether responses answer their questions correctly."""

    name: str = "verifier"

    @abstractmethod
    def verify(self, items: Sequence[VerifyItem]) -> list[bool]:
        """One bool per item: True when the verifier judges the response correct."""


def parse_judgement(text: str) -> bool:
    """True when a verifier's output judges CORRECT ("A", "\\boxed{A}", "CORRECT").

    The first standalone A/B/C letter (or CORRECT/INCORRECT/INVALID word) decides; anything
    else counts as not correct.
    """
    match = re.search(r"\b(INCORRECT|CORRECT|INVALID|[ABC])\b", text.strip().upper())
    return bool(match) and match.group(1) in ("A", "CORRECT")


def load_prompt_template(path: Optional[str]) -> str:
    """The verifier prompt: ``path``'s text, or :data:`DEFAULT_PROMPT`.

    Raises:
        ValueError: the template lacks one of ``{question}``, ``{gold_answer}``, ``{llm_response}``.
    """
    if path is None:
        return DEFAULT_PROMPT
    template = Path(path).read_text(encoding="utf-8")
    missing = [f for f in _REQUIRED_FIELDS if f not in template]
    if missing:
        raise ValueError(f"verifier prompt file {path} lacks the placeholder(s) {missing}")
    return template


class CompassVerifier(AnswerVerifier):
    """CompassVerifier (or any instruction-following judge) served by vLLM, greedy decoding.

    Args:
        model: checkpoint path or hub id (default "opencompass/CompassVerifier-3B").
        prompt_template: template with ``{question}``, ``{gold_answer}``, ``{llm_response}``.
        max_new_tokens: judgement length budget.
        llm: an existing ``vllm.LLM`` (else one is built with ``llm_kwargs``).
        **llm_kwargs: passed to ``vllm.LLM``.
    """

    name = "compass"

    def __init__(
        self,
        model: str = DEFAULT_COMPASS_MODEL,
        prompt_template: str = DEFAULT_PROMPT,
        max_new_tokens: int = 16,
        llm: Any = None,
        **llm_kwargs: Any,
    ):
        try:
            import vllm
        except ImportError as exc:
            raise ImportError("--verifier compass needs vllm (GPU machines: pip install -r requirements.txt)") from exc
        self._vllm = vllm
        self.llm = llm or vllm.LLM(model=model, **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.prompt_template = prompt_template
        self.max_new_tokens = max_new_tokens

    def build_prompt(self, item: VerifyItem) -> str:
        """Chat-formatted prompt of one item."""
        content = self.prompt_template.format(
            question=item.question,
            gold_answer=item.gold_answer,
            llm_response=item.response[-RESPONSE_TAIL_CHARS:],
        )
        from recipe.stapo.eval.backends import render_chat

        return render_chat(self.tokenizer, [{"role": "user", "content": content}])

    def verify(self, items: Sequence[VerifyItem]) -> list[bool]:
        if not items:
            return []
        params = self._vllm.SamplingParams(temperature=0.0, max_tokens=self.max_new_tokens)
        outputs = self.llm.generate([self.build_prompt(i) for i in items], sampling_params=params, use_tqdm=True)
        return [parse_judgement(o.outputs[0].text) for o in outputs]


def build_verifier(name: str, model: Optional[str] = None, prompt_file: Optional[str] = None, **kwargs: Any) -> Optional[AnswerVerifier]:
    """Verifier by name: ``"none"`` (None) or ``"compass"``."""
    if name == "none":
        return None
    if name == "compass":
        return CompassVerifier(model or DEFAULT_COMPASS_MODEL, load_prompt_template(prompt_file), **kwargs)
    raise ValueError(f"--verifier must be 'none' or 'compass', got {name!r}")
