"""The two named grading protocols of the evaluation (docs/eval.md, "Grading protocols").

A protocol fixes what decides a grade besides the verifier model and its prompt: the rule-based
answer grader that grades every sample first, what the verifier is shown as the question, and how
its output is read.

:data:`PROTOCOLS` defines the two: ``justrl`` (JustRL's ``evals/grade.py``, the paper's, the
default) and ``compassverifier`` (CompassVerifier's README usage); docs/eval.md tables how they
differ. Both feed the official ``CV_PROMPT`` through the verifier's chat template and show the
whole response.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from recipe.stapo.data.prepare import PROMPT_FORMS, PROMPT_SUFFIX


VERDICT_WORDS = {"CORRECT": "A", "INCORRECT": "B", "INVALID": "C", "INCOMPLETE": "C", "REPETITIVE": "C", "REFUSAL": "C"}
"""The labels CompassVerifier's prompts name beside each letter (``CV_PROMPT``: "A: CORRECT",
"B: INCORRECT", "C: INVALID"; ``CV_COT_PROMPT``: C is INCOMPLETE, REPETITIVE or REFUSAL)."""
_WORDS = "|".join(sorted(VERDICT_WORDS, key=len, reverse=True))
_LEADING_LETTER = re.compile(r"\W*([A-C])(?=\s*(?:$|\n|[^\w\s]|(?:" + _WORDS + r")\b))")
_LEADING_WORD = re.compile(r"\W*(" + _WORDS + r")\b")
_LONE_LETTER = re.compile(r"(?<![A-Za-z0-9\\])([A-C])(?![A-Za-z0-9])")


def compass_judgement(text: str) -> str:
    """CompassVerifier's label ("A", "B", "C", or "" when none can be read) in a verifier output.

    As the authors' ``process_judgment`` (README, ``src/cv_eval.ipynb``): the last
    ``\\boxed{A|B|C}``; else the output itself when it is exactly "A", "B" or "C" (here also with
    whitespace around it). Otherwise, in the part after the last "Final Judgment:" (the whole output
    when there is none), where the prompts' output format puts the verdict (``CV_COT_PROMPT``:
    ``Final Judgment: \\boxed{A/B/C} - <CORRECT/INCORRECT/...>``; ``CV_PROMPT``: the letter alone,
    or "CORRECT, INCORRECT, or INVALID"): the letter that part starts with (``A``, ``(A)``, ``**A**``,
    ``A - CORRECT``), else the label word it starts with (:data:`VERDICT_WORDS`), else the one
    letter A-C standing alone in it when there is exactly one; else "". The README's code takes the
    last ``(X)`` or the last capital A-C of that part instead, so a letter in an explanation after the
    verdict, or the C of "CORRECT", flips it (``A - CORRECT`` reads as C there); here it is read as
    written, and a part naming two letters without a leading verdict is unreadable."""
    boxed = re.findall(r"boxed{([A-C])}", text)
    if boxed:
        return boxed[-1]
    if text.strip() in ("A", "B", "C"):
        return text.strip()
    part = text.split("Final Judgment:")[-1]
    leading = _LEADING_LETTER.match(part)
    if leading:
        return leading.group(1)
    word = _LEADING_WORD.match(part)
    if word:
        return VERDICT_WORDS[word.group(1)]
    letters = set(_LONE_LETTER.findall(part))
    return letters.pop() if len(letters) == 1 else ""


@dataclass(frozen=True)
class GradingProtocol:
    """A grading protocol: its first-stage answer ``grader`` (``justrl`` or ``lenient``), the
    verifier's ``{question}`` (``empty`` or ``problem``, the bare problem), the ``parser`` of a
    verifier output (``exact-A`` or ``compassverifier-format``) and the ``reference`` it follows."""

    name: str
    grader: str
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
        return {"protocol": self.name, "grader": self.grader, "question": self.question, "parser": self.parser}


PROTOCOLS = {
    "justrl": GradingProtocol("justrl", "justrl", "empty", "exact-A", "thunlp/JustRL evals/grade.py"),
    "compassverifier": GradingProtocol(
        "compassverifier", "lenient", "problem", "compassverifier-format", "open-compass/CompassVerifier README"
    ),
}
DEFAULT_PROTOCOL = "justrl"  # the protocol of the paper's tables (it follows JustRL's evaluation)


def get_protocol(name: str) -> GradingProtocol:
    """The protocol named ``name`` (ValueError listing the known ones for another)."""
    if name not in PROTOCOLS:
        raise ValueError(f"--grading-protocol must be one of {sorted(PROTOCOLS)}, got {name!r}")
    return PROTOCOLS[name]


def bare_problem(user_message: str) -> str:
    """The problem of a policy prompt: ``user_message`` without the instruction data preparation
    appends in either prompt form; unchanged when it has none."""
    for joiner in PROMPT_FORMS.values():
        if user_message.endswith(joiner + PROMPT_SUFFIX):
            return user_message[: -len(joiner + PROMPT_SUFFIX)]
    return user_message
