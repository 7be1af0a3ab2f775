"""LLM answer verifiers that re-check what the rule-based answer grader did not find correct (docs/eval.md).

:class:`AnswerVerifier` is the interface (any model or service can plug in); :class:`CompassVerifier`
runs CompassVerifier as its authors do (open-compass/CompassVerifier's README): their template
filled with the question, the reference answer and the WHOLE response, through the verifier's chat
template, greedy, at most 2048 new tokens, read as a grading protocol says; only "A" counts as correct.
The project does not ship the prompt: :func:`fetch_prompt` downloads it at a pinned commit.
"""

from __future__ import annotations

import argparse
import ast
import string
import sys
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from recipe.stapo.eval.backends import GenerationBackend, LazyBackend, build_backend, render_chat
from recipe.stapo.eval.generate import text_sha256
from stapo_core.fileio import atomic_write
from recipe.stapo.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS, GradingProtocol

DEFAULT_COMPASS_MODEL = "opencompass/CompassVerifier-3B"
OFFICIAL_REPOSITORY = "open-compass/CompassVerifier"
OFFICIAL_PATH = "src/prompts.py"
OFFICIAL_COMMIT = "c5d6700ae5a820ed1232c847a57e7060d130b7df"
OFFICIAL_URL = f"https://raw.githubusercontent.com/{OFFICIAL_REPOSITORY}/{OFFICIAL_COMMIT}/{OFFICIAL_PATH}"
OFFICIAL_PROMPT_SHA256 = {
    "CV_PROMPT": "aee9c27520639ca543f0b5077164dc32c1976be0f16c87bee7055f3b7ba45e72",
    "CV_COT_PROMPT": "3d7456fb730b7517ca1f3bc1a28a3cc8847522ea6cc721a4d709f28bd07b4a10",
}
DEFAULT_PROMPT_NAME = "CV_PROMPT"
COMPASS_MAX_NEW_TOKENS = 2048  # the judgement budget CompassVerifier's authors use
PROMPT_FIELDS = ("question", "gold_answer", "llm_response")
CONTEXT_RESERVE_TOKENS = 32  # kept free for the judgement when a prompt is shortened to fit
_SAMPLE = {"question": "What is $\\frac{1}{2} + \\frac{1}{2}$?", "gold_answer": "1", "llm_response": "So the answer is $\\boxed{1}$."}


@dataclass(frozen=True)
class VerifyItem:
    """One (question, reference, response) triple to judge."""

    question: str
    gold_answer: str
    response: str


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one item: ``judgement`` the parsed label ("A", "B", "C", or ""
    when none could be read), ``response_chars_dropped`` what was cut from the start of the
    response to fit the verifier's context."""

    correct: bool
    judgement: Optional[str] = None
    output: Optional[str] = None
    response_chars_dropped: int = 0


class AnswerVerifier(ABC):
    """Judges whether responses answer their questions correctly."""

    name: str = "verifier"

    @abstractmethod
    def verify(self, items: Sequence[VerifyItem]) -> list:
        """One verdict per item: a bool (True: correct) or a :class:`Verdict`."""

    def identity(self) -> dict:
        """Everything that decides this verifier's verdicts (cached verdicts are reused only under
        the same identity). A custom verifier whose verdicts depend on its arguments must include
        them here."""
        cls = type(self)
        return {"kind": "custom", "class": f"{cls.__module__}.{cls.__qualname__}", "name": self.name}

    def describe(self) -> str:
        """One line naming the verifier, for summaries and tables."""
        return f"custom verifier {self.name}"

    def close(self) -> None:
        """Free the model the verifier runs on (vLLM: its engine processes); none by default."""


@dataclass(frozen=True)
class VerifierPrompt:
    """A ``str.format`` verifier prompt template, the file (and variable) it was read from, and the
    name of the official template it equals (``"CV_PROMPT"``...) or None."""

    template: str
    source: str
    sha256: str
    official: Optional[str]

    def render(self, question: str, gold_answer: str, llm_response: str) -> str:
        return self.template.format(question=question, gold_answer=gold_answer, llm_response=llm_response)

    def label(self) -> str:
        if self.official:
            return f"official {self.official} of {OFFICIAL_REPOSITORY}@{OFFICIAL_COMMIT[:7]}"
        return f"custom prompt {self.sha256[:12]} ({self.source})"


def _template_from_python(text: str, path: Path, name: str) -> str:
    """The string literal assigned to ``name`` in the Python file ``path`` holding ``text`` (read with
    ``ast``; nothing runs)."""
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as exc:
        raise ValueError(f"verifier prompt file {path}: not valid Python ({exc.msg}, line {exc.lineno})") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                value = None
            if isinstance(value, str):
                return value
            raise ValueError(f"verifier prompt file {path}: {name} is not a string literal")
    raise ValueError(
        f"verifier prompt file {path}: no {name} = \"...\" in it (CompassVerifier's src/prompts.py defines "
        "CV_PROMPT and CV_COT_PROMPT); pass --verifier-prompt-name"
    )


def load_verifier_prompt(path: str | Path, name: str = DEFAULT_PROMPT_NAME) -> VerifierPrompt:
    """Read and check a verifier prompt: a ``.py`` file (the template is the string assigned to
    ``name``, e.g. CompassVerifier's ``src/prompts.py``) or a text file (its whole text).

    The template is rendered once with a sample question, answer and response, so a bad template
    fails here, before any generation.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"verifier prompt file {path} not found; {FETCH_HINT}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        return _checked_prompt(_template_from_python(text, path, name), f"{path}:{name}")
    return _checked_prompt(text, str(path))


def _checked_prompt(template: str, source: str) -> VerifierPrompt:
    """``template`` (from ``source``) as a :class:`VerifierPrompt`, checked as :func:`load_verifier_prompt` says."""
    fix = (
        "a template is filled by str.format: the placeholders are {question}, {gold_answer} and "
        "{llm_response}, and every literal brace is doubled ({{ and }}, e.g. \\boxed{{}} or $\\frac{{1}}{{2}}$)"
    )
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ValueError(f"verifier prompt {source} cannot be used: {exc}; {fix}") from None
    missing = [f"{{{f}}}" for f in PROMPT_FIELDS if f not in fields]
    other = sorted(f"{{{f}}}" for f in fields - set(PROMPT_FIELDS))
    if missing or other:
        what = "; ".join(filter(None, [f"lacks {missing}" if missing else "", f"has unknown field(s) {other}" if other else ""]))
        raise ValueError(f"verifier prompt {source} {what}; {fix}")
    prompt = VerifierPrompt(template, source, text_sha256(template), None)
    try:
        prompt.render(**_SAMPLE)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise ValueError(f"verifier prompt {source} does not render ({type(exc).__name__}: {exc}); {fix}") from None
    official = next((n for n, sha in OFFICIAL_PROMPT_SHA256.items() if sha == prompt.sha256), None)
    return VerifierPrompt(template, source, prompt.sha256, official)


FETCH_HINT = (
    "the paper's grading uses CompassVerifier's official prompt, which this project does not ship a copy of: "
    f"run `python -m recipe.stapo.eval.verifier fetch-prompt --out FILE` (downloads {OFFICIAL_PATH} of "
    f"{OFFICIAL_REPOSITORY} at commit {OFFICIAL_COMMIT[:7]} and checks its hash) and pass "
    "--verifier-prompt-file FILE, or put it at <benchmarks-dir>/compassverifier/prompts.py; "
    "--verifier none gives rule-only results"
)


class CompassVerifier(AnswerVerifier):
    """CompassVerifier (or any judge model answering A/B/C) on a generation backend, fed as a
    grading protocol says (:mod:`recipe.stapo.eval.protocols`): its ``{question}`` (empty for
    ``justrl``, the bare problem for ``compassverifier``) and its parser (an output exactly "A",
    or :func:`~recipe.stapo.eval.protocols.compass_judgement`).

    The whole response is shown; only a prompt longer than the backend's context is shortened
    (:meth:`fitted_prompt`), and the verdict records how many characters were dropped. ``model``
    and ``dtype`` are part of the identity only: the backend does the loading.
    """

    name = "compass"

    def __init__(self, backend: GenerationBackend, prompt: VerifierPrompt, model: str = DEFAULT_COMPASS_MODEL,
                 max_new_tokens: int = COMPASS_MAX_NEW_TOKENS, protocol: Optional[GradingProtocol] = None,
                 dtype: str = "auto"):
        self.backend, self.prompt, self.model, self.max_new_tokens = backend, prompt, model, max_new_tokens
        self.protocol = protocol or PROTOCOLS[DEFAULT_PROTOCOL]
        self.dtype = dtype

    def identity(self) -> dict:
        return {
            "kind": "compass",
            "model": self.model,
            "prompt_sha256": self.prompt.sha256,
            "prompt_official": self.prompt.official,
            "input": "question, gold answer, whole response (start cut only beyond the context)",
            "question": self.protocol.question,
            "chat_template": True,
            "decoding": "greedy",
            "max_new_tokens": self.max_new_tokens,
            "parser": self.protocol.parser,
            "dtype": self.dtype,
        }

    def describe(self) -> str:
        return f"CompassVerifier {self.model} with the {self.prompt.label()}"

    def close(self) -> None:
        self.backend.close()

    def build_prompt(self, item: VerifyItem, response: Optional[str] = None) -> str:
        """Chat-formatted prompt of one item (``response`` replaces the item's, e.g. shortened)."""
        question = self.protocol.verifier_question(item.question)
        content = self.prompt.render(question, item.gold_answer, item.response if response is None else response)
        return render_chat(self.backend.tokenizer, [{"role": "user", "content": content}])

    def fitted_prompt(self, item: VerifyItem) -> tuple[str, int]:
        """``(prompt, characters dropped from the start of the response)``: the whole response
        unless the prompt would not leave :data:`CONTEXT_RESERVE_TOKENS` of the context free."""
        prompt = self.build_prompt(item)
        limit = self.backend.context_length()
        if limit is None:
            return prompt, 0
        budget = limit - CONTEXT_RESERVE_TOKENS
        tokenizer = self.backend.tokenizer
        excess = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) - budget
        if excess <= 0:
            return prompt, 0
        ids = tokenizer(item.response, add_special_tokens=False)["input_ids"]
        keep = max(0, len(ids) - excess - 8)
        while True:
            tail = tokenizer.decode(ids[len(ids) - keep :]) if keep else ""
            prompt = self.build_prompt(item, tail)
            if keep == 0 or len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) <= budget:
                return prompt, len(item.response) - len(tail)
            keep = max(0, keep - max(8, keep // 50))

    def verify(self, items: Sequence[VerifyItem]) -> list[Verdict]:
        if not items:
            return []
        fitted = [self.fitted_prompt(item) for item in items]
        outputs = self.backend.greedy([prompt for prompt, _ in fitted], self.max_new_tokens)
        verdicts = []
        for (_, dropped), output in zip(fitted, outputs):
            label = self.protocol.judgement(output)
            verdicts.append(Verdict(label == "A", label, output, dropped))
        return verdicts


def build_verifier(
    name: str,
    model: Optional[str] = None,
    prompt: Optional[VerifierPrompt] = None,
    backend: str = "vllm",
    protocol: Optional[GradingProtocol] = None,
    dtype: str = "auto",
    **backend_kwargs: Any,
) -> Optional[AnswerVerifier]:
    """Verifier by name: ``"none"`` (None) or ``"compass"`` (its judge model loaded on ``backend``,
    ``"vllm"`` or ``"hf"``, in ``dtype`` (``auto``: the checkpoint's own, as both references load
    it), on first use: with every verdict cached it is never loaded), fed as ``protocol`` says."""
    if name == "none":
        return None
    if name == "compass":
        if prompt is None:
            raise ValueError(f"--verifier compass needs a prompt: {FETCH_HINT}")
        model = model or DEFAULT_COMPASS_MODEL
        load = lambda: build_backend(backend, model, dtype=dtype, **backend_kwargs)  # noqa: E731
        return CompassVerifier(LazyBackend(load), prompt, model, protocol=protocol, dtype=dtype)
    raise ValueError(f"--verifier must be 'none' or 'compass', got {name!r}")


def fetch_prompt(out: str | Path, source: Optional[str] = None) -> VerifierPrompt:
    """Write CompassVerifier's ``src/prompts.py`` at :data:`OFFICIAL_COMMIT` (downloaded, or the
    local copy ``source``) to ``out`` once its ``CV_PROMPT`` is checked to be the official text."""
    if source is None:
        try:
            with urllib.request.urlopen(OFFICIAL_URL, timeout=60) as response:  # noqa: S310 (fixed https URL)
                text = response.read().decode("utf-8")
        except OSError as exc:  # urllib's URLError and socket timeouts are OSErrors
            raise ValueError(
                f"cannot download {OFFICIAL_URL} ({getattr(exc, 'reason', exc)}); nothing written. Without internet "
                f"on this machine: download that file on one that has it, copy it here and run `python -m "
                f"recipe.stapo.eval.verifier fetch-prompt --source FILE --out {out}` (it checks the file's hash "
                "and writes it), or grade rule-only with --verifier none (VERIFIER=none in eval.sh; not the "
                "paper's grading)"
            ) from None
    else:
        text = Path(source).read_text(encoding="utf-8")
    source_name = f"{out}:{DEFAULT_PROMPT_NAME}"
    prompt = _checked_prompt(_template_from_python(text, Path(out), DEFAULT_PROMPT_NAME), source_name)
    if prompt.official != DEFAULT_PROMPT_NAME:
        raise ValueError(
            f"{source or OFFICIAL_URL}: its CV_PROMPT has sha256 {prompt.sha256}, not the official "
            f"{OFFICIAL_PROMPT_SHA256[DEFAULT_PROMPT_NAME]} ({OFFICIAL_REPOSITORY}@{OFFICIAL_COMMIT[:7]}); nothing written"
        )
    atomic_write(out, text)
    return prompt


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.eval.verifier", description="CompassVerifier's prompt")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-prompt", help=f"download {OFFICIAL_PATH} of {OFFICIAL_REPOSITORY} at {OFFICIAL_COMMIT[:7]}")
    fetch.add_argument("--out", required=True, help="where to write it (e.g. data/stapo/compassverifier/prompts.py)")
    fetch.add_argument("--source", default=None, help="check and copy this local copy instead of downloading")
    check = sub.add_parser("check-prompt", help="say whether a prompt file is usable and official")
    check.add_argument("file")
    check.add_argument("--name", default=DEFAULT_PROMPT_NAME)
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch-prompt":
            prompt = fetch_prompt(args.out, args.source)
            print(f"wrote {args.out}: {prompt.label()}")
        else:
            print(load_verifier_prompt(args.file, args.name).label())
    except (ValueError, FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
