"""The table of verdicts in docs/memory.md (``python -m stapo_memory.verdicts``): the paper's
run scripts on 40 / 48 / 80 / 96 / 141 GB cards, on one node and on eight. The document's table is
the one the command makes; every run the count (tests/stapo_memory/test_count_on_cpu.py) fits passes
the preflight, every run it does not is refused, and the changes a refusal names fit by the count and
pass the whole preflight and verl's validation on a stand-in for the cluster's storage."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf, open_dict

from recipe.stapo.driver import compose, prepare
from recipe.stapo.preflight import problems_of
from stapo_memory import model as mm
from stapo_memory import verdicts
from stapo_memory.bench_layer_memory import counted_totals
from stapo_memory.shape import builtin_shape
from stapo_memory.terms import GIB
from tests.helpers.cluster_files import use_fake_cluster
from tests.helpers.paths import REPO

pytestmark = pytest.mark.slow

DOC = REPO / "docs" / "memory.md"


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return verdicts.cells(str(tmp_path_factory.mktemp("ckpt")))


def fits_by_the_count(est: mm.Estimate, gpu: float) -> bool:
    """Every pass's count plus the estimate's margin within the GPU, and vLLM's share enough for it."""
    counted = counted_totals(est)
    for p in est.passes:
        modelled = counted[p.name] - p.components.get("vLLM (gpu_memory_utilization)", 0.0) \
            - p.components.get("overhead", 0.0)
        if counted[p.name] + mm.MARGIN_FIXED_BYTES + mm.MARGIN_FRACTION * modelled > gpu:
            return False
    return mm.vllm_share_fits(est, gpu)


def _estimate(config) -> tuple[mm.Estimate, float]:
    gpu = float(OmegaConf.select(config, "recipe.gpu_mem_gb")) * GIB
    shape = builtin_shape(str(config.actor_rollout_ref.model.path))
    return mm.estimate(shape, mm.settings_from_config(config), gpu), gpu


def test_the_documents_tables_are_the_ones_the_command_makes(table, tmp_path, monkeypatch):
    """The command docs/memory.md shows, run as written on a copy of the document (its arguments given
    to the module's ``main``, the table of verdicts taken from the module's fixture rather than
    computed a second time): it changes nothing (the table of verdicts and the written count are
    current)."""
    document = DOC.read_text()
    (command,) = re.findall(r"^python -m stapo_memory\.verdicts --write docs/memory\.md$", document, re.M)
    (tmp_path / "docs").mkdir()
    copy_ = tmp_path / "docs" / "memory.md"
    copy_.write_text(document)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(verdicts, "cells", lambda workdir=None: table)
    assert verdicts.main(command.split()[3:]) == 0
    assert copy_.read_text() == document, \
        "docs/memory.md's tables are stale: python -m stapo_memory.verdicts --write docs/memory.md"
    assert len(table) == 12 * len(verdicts.CARDS) * len(verdicts.NODES)


def test_the_command_runs_as_a_module(tmp_path):
    """``python -m stapo_memory.verdicts`` reaches ``main`` (its usage, under its own name, without computing
    a table)."""
    proc = subprocess.run([sys.executable, "-m", "stapo_memory.verdicts", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--write DOC" in proc.stdout and "--check DOC" in proc.stdout
    assert proc.stdout.startswith("usage: python -m stapo_memory.verdicts ")


def test_the_check_command_fails_on_a_stale_table(tmp_path, monkeypatch, table):
    stale = tmp_path / "memory.md"
    stale.write_text(verdicts.replace_in(DOC.read_text(), "| stale |"))
    monkeypatch.setattr(verdicts, "cells", lambda workdir=None: table)
    assert verdicts.main(["--check", str(stale)]) == 1
    assert verdicts.main(["--write", str(stale)]) == 0
    assert verdicts.main(["--check", str(stale)]) == 0 and stale.read_text() == DOC.read_text()


def test_the_preflight_passes_exactly_the_runs_that_fit_by_the_count(table, tmp_path):
    for (model, method, nodes, card), config in verdicts.run_configs(str(tmp_path)):
        cell = table[(model, method, nodes, card)]
        est, gpu = _estimate(config)
        assert fits_by_the_count(est, gpu) == cell.passes, (model, method, nodes, card, cell.text())
        if not cell.passes:
            assert cell.plans, (model, method, nodes, card)


def _hydra_overrides(plan) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in plan.overrides.items()]


def test_the_changes_a_refusal_names_fit_by_the_count_and_pass_the_whole_preflight(table, tmp_path, monkeypatch):
    """On a stand-in for the cluster's storage, as the driver runs it: the preflight (paths included)
    then verl's own validation, with the changes of every refused run of the table applied. Hydra
    takes the overrides as the refusal prints them (composed once per set of keys changed); each run
    script's config is composed once and the changes set on a copy of it."""
    use_fake_cluster(tmp_path / "shared", monkeypatch)
    composed_keys = set()
    bases = {}
    for (model, method, nodes, card), cell in table.items():
        if cell.passes:
            continue
        gib = dict(verdicts.CARDS)[card]
        if (model, method) not in bases:
            bases[(model, method)] = compose([f"method={method}", f"model={model}", "trainer.n_gpus_per_node=8",
                                              "trainer.logger=[console]",
                                              f"trainer.default_local_dir={tmp_path}/ckpt/{model}_{method}"])
        for plan in cell.plans.values():
            keys = frozenset(plan.overrides)
            if keys not in composed_keys:  # Hydra accepts the printed overrides
                compose([f"method={method}", f"model={model}", *_hydra_overrides(plan)])
                composed_keys.add(keys)
            config = copy.deepcopy(bases[(model, method)])
            with open_dict(config):
                for key, value in {"trainer.nnodes": nodes, "recipe.gpu_mem_gb": gib, **plan.overrides}.items():
                    OmegaConf.update(config, key, value)
            prepare(config, log=lambda _: None, environ={})
            est, gpu = _estimate(config)
            assert fits_by_the_count(est, gpu), (model, method, nodes, card, plan.text())


def test_a_refused_run_still_refused_without_the_changes_is_not_silently_passed(table, tmp_path):
    """The other direction of 'with and without the advice': the shipped run the table marks refused
    is refused by the whole preflight, and passes once its changes are applied (no other key changed)."""
    (model, method, nodes, card), cell = next((k, c) for k, c in table.items() if not c.passes and "settings" in c.plans)
    config = verdicts.run_config(method, model, nodes, dict(verdicts.CARDS)[card], str(tmp_path))
    assert any(p.key.startswith("GPU memory") for p in problems_of(config, verdicts.SUBMIT))
    changed = copy.deepcopy(config)
    with open_dict(changed):
        for key, value in cell.plans["settings"].overrides.items():
            OmegaConf.update(changed, key, value)
    assert problems_of(changed, verdicts.SUBMIT) == []
