"""The preflight's memory verdict for every paper run on common cards, as one table (docs/memory.md,
"Verdicts on common cards").

    python -m stapo_memory.verdicts                          # print the table and the written count
    python -m stapo_memory.verdicts --write docs/memory.md   # replace both in the document
    python -m stapo_memory.verdicts --check docs/memory.md   # exit 1 when the document's differ

Each cell is one paper run through the whole preflight with ``LAUNCH=submit`` (docs/memory.md says what
a cell shows); beside the table, one paper run's count written out term by term (:func:`terms`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf, open_dict

from recipe.stapo.driver import compose, ensure_loss_statistics
from recipe.stapo.methods import methods
from recipe.stapo.preflight import problems_of
from recipe.stapo.preflight.context import model_path
from recipe.stapo.preflight.problem import ACTOR, REF, ROLLOUT
from stapo_core.fileio import atomic_write

from . import model as mm
from .advice import Plan
from .preflight import verified_plans, verifier
from .shape import builtin_shape

#: the cards of the table: (column name, GiB as CUDA reports them), the memory model's ``GPU_CAPACITY_GIB``
CARDS = tuple((card.split()[-1].replace("GB", " GB"), gib) for card, gib in mm.GPU_CAPACITY_GIB.items())
NODES = (1, 8)
GPUS_PER_NODE = 8
MODELS = ("qwen3_1_7b", "qwen3_8b", "qwen3_14b")
#: short names of the keys a cell's changes set (the table's legend)
SHORT = {f"{ROLLOUT}.gpu_memory_utilization": "util",
         f"{ACTOR}.ppo_max_token_len_per_gpu": "update",
         f"{ROLLOUT}.log_prob_max_token_len_per_gpu": "log-prob",
         f"{REF}.log_prob_max_token_len_per_gpu": "ref",
         f"{ACTOR}.ulysses_sequence_parallel_size": "sp",
         f"{REF}.ulysses_sequence_parallel_size": None,
         f"{ACTOR}.fsdp_config.optimizer_offload": "optimizer-offload",
         f"{ACTOR}.fsdp_config.param_offload": "param-offload",
         f"{ACTOR}.fsdp_config.use_no_sync_for_gradient_accumulation": "no-sync",
         "trainer.nnodes": "nodes",
         "trainer.n_gpus_per_node": "gpus/node"}
BEGIN, END = "<!-- verdicts: python -m stapo_memory.verdicts --write docs/memory.md -->", "<!-- verdicts end -->"
#: the run whose count docs/memory.md writes out term by term
TERMS_RUN = ("stapo", "qwen3_8b", 8, 79.1)
TERMS_BEGIN = ("<!-- terms: python -m stapo_memory.verdicts --write docs/memory.md "
               f"(method={TERMS_RUN[0]} model={TERMS_RUN[1]}, {TERMS_RUN[2]} nodes, {TERMS_RUN[3]} GiB) -->")
TERMS_END = "<!-- terms end -->"
SUBMIT = {"LAUNCH": "submit"}


@dataclass
class Cell:
    """One run's verdict: the estimated rollout pass and largest training pass (name, bytes), whether
    the preflight passes it, and the verified changes of its refusal (kind -> plan)."""

    rollout_bytes: float
    training_pass: str
    training_bytes: float
    passes: bool
    plans: dict

    def text(self) -> str:
        head = f"{self.rollout_bytes / mm.GIB:.1f} / {self.training_bytes / mm.GIB:.1f} {self.training_pass}"
        if self.passes:
            return f"{head} ok"
        if "settings" in self.plans:
            return f"{head}: {short(self.plans['settings'])}"
        others = [short(self.plans[k]) for k in ("offload", "gpus") if k in self.plans]
        return f"{head}: only " + " or ".join(others) if others else f"{head}: no fit"


def short(plan: Plan) -> str:
    parts = []
    for key, value in plan.overrides.items():
        name = SHORT.get(key, key)
        if name is not None:
            parts.append(name if value is True else f"{name} {str(value).lower() if isinstance(value, bool) else value}")
    return ", ".join(parts)


def run_config(method: str, model: str, nnodes: int, gpu_gib: float, workdir: str):
    """The run's config as its run script composes it, prepared as the driver prepares it before the
    preflight (the statistics its loss reads switched on)."""
    config = compose([f"method={method}", f"model={model}", f"trainer.nnodes={nnodes}",
                      f"trainer.n_gpus_per_node={GPUS_PER_NODE}", f"recipe.gpu_mem_gb={gpu_gib}",
                      "trainer.logger=[console]", f"trainer.default_local_dir={workdir}/{model}_{method}"])
    ensure_loss_statistics(config, log=lambda _: None)
    return config


def cell(config) -> Cell:
    """The verdict of one prepared config (see the module docstring)."""
    gpu = float(OmegaConf.select(config, "recipe.gpu_mem_gb")) * mm.GIB
    shape = builtin_shape(model_path(config))
    est = mm.estimate(shape, mm.settings_from_config(config), gpu)
    found = problems_of(config, SUBMIT)
    other = [p for p in found if not p.key.startswith("GPU memory")]
    if other:
        raise ValueError("the preflight refuses the run for another reason: " + "; ".join(map(str, other)))
    plans = {} if not found else verified_plans(est, gpu, GPUS_PER_NODE,
                                                verifier(config, lambda changed: problems_of(changed, SUBMIT)))
    training = max((p for p in est.passes if p.name != "rollout"), key=lambda p: p.total)
    return Cell(est.passes[0].total, training.name, training.total, not found, plans)


def run_configs(workdir: str):
    """``((model, method, nodes, card), config)`` for every run of the table. A run script's config is
    composed once (composing costs a second); its node count and ``recipe.gpu_mem_gb`` are then set in
    place, so each config is valid until the next one is taken (copy it to keep it)."""
    for model in MODELS:
        for method in methods():
            config = run_config(method, model, NODES[0], CARDS[0][1], workdir)
            for nodes in NODES:
                for card, gib in CARDS:
                    with open_dict(config):
                        OmegaConf.update(config, "trainer.nnodes", nodes)
                        OmegaConf.update(config, "recipe.gpu_mem_gb", gib)
                    yield (model, method, nodes, card), config


def cells(workdir: Optional[str] = None) -> dict[tuple[str, str, int, str], Cell]:
    """(model, method, nodes, card) -> :class:`Cell` for every run of the table."""
    with tempfile.TemporaryDirectory() as tmp:
        return {key: cell(config) for key, config in run_configs(workdir or tmp)}


def markdown(table: dict[tuple[str, str, int, str], Cell]) -> str:
    """The table: a row per run script and node count, a column per card."""
    lines = ["| run script | nodes | " + " | ".join(card for card, _ in CARDS) + " |",
             "|---|---|" + "---|" * len(CARDS)]
    models = [m for m in MODELS if any(k[0] == m for k in table)]
    methods = list(dict.fromkeys(k[1] for k in table))
    for model in models:
        for method in methods:
            script = f"qwen3_{model.split('_', 1)[1].replace('_', '.')}_{method}.sh"
            for nodes in NODES:
                row = [table[(model, method, nodes, card)].text() for card, _ in CARDS]
                lines.append(f"| `{script}` | {nodes} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def terms(method: str, model: str, nnodes: int, gpu_gib: float) -> str:
    """The count of one run written out: each pass at its peak moment, component by component, with the
    code it follows, and the update's every moment."""
    with tempfile.TemporaryDirectory() as tmp:
        config = run_config(method, model, nnodes, gpu_gib, tmp)
    shape = builtin_shape(model_path(config))
    est = mm.estimate(shape, mm.settings_from_config(config), gpu_gib * mm.GIB)
    lines = ["| pass (moment) | component | GiB | follows |", "|---|---|---|---|"]
    for p in est.passes:
        head = f"`{p.name}` ({p.phase}{f', {p.tokens} tokens' if p.tokens else ''}): {p.total / mm.GIB:.1f}"
        for i, (name, size) in enumerate(sorted(p.components.items(), key=lambda kv: -kv[1])):
            lines.append(f"| {head if i == 0 else ''} | {name} | {size / mm.GIB:.2f} | {mm.COMPONENT_SOURCES[name]} |")
        if len(p.phases) > 1:
            moments = ", ".join(f"{k} {v / mm.GIB:.1f}" for k, v in p.phases.items())
            lines.append(f"| | every moment | | {moments} |")
    return "\n".join(lines)


def replace_in(document: str, table: str, begin: str = BEGIN, end: str = END) -> str:
    """``document`` with the text between ``begin`` and ``end`` replaced by ``table``."""
    if begin not in document or end not in document:
        raise ValueError(f"the document has no such table: no {begin!r} ... {end!r}")
    head, rest = document.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{table}\n{end}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m stapo_memory.verdicts", description=__doc__.split("\n\n")[0])
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="DOC", help="replace the table in this markdown document")
    group.add_argument("--check", metavar="DOC", help="exit 1 when this document's table differs")
    args = p.parse_args(argv)
    table = markdown(cells())
    written = terms(*TERMS_RUN)

    def updated(document: str) -> str:
        return replace_in(replace_in(document, table), written, TERMS_BEGIN, TERMS_END)

    if args.write:
        path = Path(args.write)
        atomic_write(path, updated(path.read_text()))
    elif args.check:
        path = Path(args.check)
        if updated(path.read_text()) != path.read_text():
            print(f"{path}: the verdict table or the written count differs from the model's; regenerate them with "
                  f"python -m stapo_memory.verdicts --write {path}", file=sys.stderr)
            return 1
    else:
        print(table + "\n\n" + written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
