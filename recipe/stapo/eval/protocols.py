"""The two named grading protocols of the evaluation (docs/eval.md, "Grading protocols").

A protocol fixes what decides a grade besides the verifier model and its prompt: the rule that
grades every sample first, what the verifier is shown as the question, and how its output is read.

- ``justrl``: how JustRL's ``evals/grade.py`` grades, the protocol the STAPO paper says its tables
  follow, and the default: JustRL's rule (:mod:`recipe.stapo.eval.justrl_rule`), an empty question
  (JustRL's jsonl inputs carry none, so ``{question}`` is filled with ""), and only an output that is
  exactly ``A`` once surrounding whitespace is stripped counts as correct.
- ``compassverifier``: CompassVerifier's README usage: the lenient rule
  (:mod:`recipe.stapo.reward.lenient`) first, the bare problem as the question (the benchmark's
  problem without the policy's "Please reason step by step..." instruction), and the README's
  ``process_judgment`` parsing (:func:`compass_judgement`).

Both feed the official ``CV_PROMPT`` through the verifier's chat template, greedy, at most 2048 new
tokens, load the verifier in its checkpoint's own dtype, and show the whole response.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from recipe.stapo.data.prepare import PROMPT_SUFFIX


def compass_judgement(text: str) -> str:
    """CompassVerifier's label in a verifier output, parsed as its authors do: the last
    ``\\boxed{A|B|C}``; else the whole output when it is exactly "A", "B" or "C"; else, in the part
    after the last "Final Judgment:", the last ``(X)``-style letter, else the last capital A, B or C
    anywhere in it; else "" (unreadable). Note that the last rule reads a bare "CORRECT" as "C"."""
    boxed = re.findall(r"boxed{([A-C])}", text)
    if boxed:
        return boxed[-1]
    if text in ("A", "B", "C"):
        return text
    tail = text.split("Final Judgment:")[-1]
    for pattern in (r"\(([A-C])\)*", r"([A-C])"):
        found = re.findall(pattern, tail)
        if found:
            return found[-1]
    return ""


@dataclass(frozen=True)
class GradingProtocol:
    """A grading protocol.

    Attributes:
        name: ``justrl`` or ``compassverifier``.
        rule: the first-stage rule (``justrl`` or ``lenient``).
        question: what the verifier's ``{question}`` is: ``empty`` or ``problem`` (the bare problem).
        parser: how a verifier output is read: ``exact-A`` or ``compassverifier-readme``.
        reference: where the protocol comes from.
    """

    name: str
    rule: str
    question: str
    parser: str
    reference: str

    def verifier_question(self, user_message: str) -> str:
        """The ``{question}`` the verifier is shown for a problem whose policy prompt was
        ``user_message``."""
        return "" if self.question == "empty" else bare_problem(user_message)

    def judgement(self, output: str) -> str:
        """The label ("A", "B", "C", or "" when unreadable) of a verifier output; "A" is correct."""
        if self.parser == "exact-A":
            text = output.strip()
            return text if text in ("A", "B", "C") else ""
        return compass_judgement(output)

    def identity(self) -> dict:
        return {"protocol": self.name, "rule": self.rule, "question": self.question, "parser": self.parser}


PROTOCOLS = {
    "justrl": GradingProtocol("justrl", "justrl", "empty", "exact-A", "thunlp/JustRL evals/grade.py"),
    "compassverifier": GradingProtocol(
        "compassverifier", "lenient", "problem", "compassverifier-readme", "open-compass/CompassVerifier README"
    ),
}
DEFAULT_PROTOCOL = "justrl"
"""The protocol the paper's tables were graded with (it follows JustRL's evaluation)."""


def get_protocol(name: str) -> GradingProtocol:
    """The protocol named ``name``.

    Raises:
        ValueError: an unknown name (lists the known ones).
    """
    if name not in PROTOCOLS:
        raise ValueError(f"--grading-protocol must be one of {sorted(PROTOCOLS)}, got {name!r}")
    return PROTOCOLS[name]


def bare_problem(user_message: str) -> str:
    """The problem of a policy prompt: ``user_message`` without the trailing ``"\\n\\n" +``
    :data:`~recipe.stapo.data.prepare.PROMPT_SUFFIX` that data preparation appends (unchanged when
    it has none)."""
    suffix = "\n\n" + PROMPT_SUFFIX
    return user_message[: -len(suffix)] if user_message.endswith(suffix) else user_message
