"""The CPU wing's patch table (stapo_cpu.patches.install): on the CPU path every entry that applies is in
place once, before the core's table, and a second install changes nothing; every reference resolves;
``python -m stapo_cpu.patches`` is docs/cpu_patches.md. Off the CPU path it changes nothing
(tests/stapo_cpu/patches/test_cpu_shims_on_cpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.helpers.anchors import anchor_problem
from tests.helpers.paths import REPO

#: in the CPU environment ``import verl`` imports both activation modules (VERL_USE_EXTERNAL_MODULES)
PROBE = textwrap.dedent(
    """
    import json, sys
    import verl
    from stapo_cpu.patches.install import PATCHES, install
    from verl_patches.install import PATCHES as CORE, install as core_install
    from verl_patches.registry import applies_here, is_applied, original_of, _owner_and_attr
    def home(obj):
        obj = getattr(obj, "_function", obj)  # a ray.remote function: the function it runs
        name = obj.__name__ if isinstance(obj, type(json)) else getattr(obj, "__module__", "") or ""
        return name.split(".")[0]
    print(json.dumps({
        "order": [m for m in sys.modules if m in ("stapo_cpu.activate", "verl_patches.activate")],
        "applied": {p.name: is_applied(p) for p in PATCHES},
        "applies": {p.name: applies_here(p) for p in PATCHES},
        "core_applied": [p.name for p in CORE if is_applied(p)],
        "second_install": install() + core_install(),
        "originals": {p.name: home(original_of(getattr(*_owner_and_attr(p.target))))
                      for p in PATCHES if p.kind == "wrap" and is_applied(p)},
    }))
    """
)


def test_in_the_cpu_environment_every_wing_patch_is_applied_once_before_the_core_table():
    """``import verl`` in the CPU environment (:func:`stapo_cpu.trainer.cpu_env`) imports the wing's
    activation, then the core's, and every entry of both tables that applies here is in place."""
    from stapo_cpu.patches.install import PATCHES
    from stapo_cpu.trainer import cpu_env
    from verl_patches.install import PATCHES as CORE

    env = cpu_env(base={k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_PLATFORM")})
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    probed = json.loads(out.stdout.strip().splitlines()[-1])
    assert probed["order"] == ["stapo_cpu.activate", "verl_patches.activate"]
    assert probed["applied"] == probed["applies"], probed
    assert sum(probed["applied"].values()) >= len(PATCHES) - 1
    assert probed["core_applied"] == [p.name for p in CORE]
    assert probed["second_install"] == []
    homes = {"verl", "torch", "uuid", "importlib", "vllm"}
    assert probed["originals"] and set(probed["originals"].values()) <= homes, probed["originals"]


def test_every_reference_in_the_wing_table_resolves():
    """Targets, wrappers, registrations and conditions all name existing objects in verl 0.9.1 and vLLM's
    CPU build, and every entry says what, why, what it relies on (its anchors first the ``def`` line of
    the function it wraps) and when to drop it; no name is also the core table's."""
    from stapo_cpu.patches.install import PATCHES
    from verl_patches.install import PATCHES as CORE
    from verl_patches.registry import _owner_and_attr, resolve

    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names)) and not set(names) & {p.name for p in CORE}
    for patch in PATCHES:
        for ref in (patch.wrapper, patch.register, patch.registered, patch.applies):
            if ref is not None:
                assert callable(resolve(ref)), f"{patch.name}: {ref}"
        owner, attr = _owner_and_attr(patch.target)
        assert hasattr(owner, attr) or patch.kind == "register", patch.target
        assert all(len(text) > 10 for text in (patch.changes, patch.why, patch.relies_on, patch.drop_when))
        assert anchor_problem(patch) is None, anchor_problem(patch)  # what python -m stapo_cpu.patches check reads


def test_every_entry_applies_to_the_installed_verl_vllm_and_torch():
    """``python -m stapo_cpu.patches check`` finds every anchor in the installed verl 0.9.1,
    vLLM's CPU build and torch: one ``applies`` line per entry, in the table's order, exit 0."""
    from stapo_cpu.patches.install import PATCHES

    out = subprocess.run([sys.executable, "-m", "stapo_cpu.patches", "check"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert out.stdout.splitlines() == [f"applies  {p.name}" for p in PATCHES] + [
        f"{len(PATCHES)} apply, 0 break, 0 obsolete (verl: installed)"]


def test_docs_page_is_what_python_m_stapo_cpu_patches_prints():
    from stapo_cpu.patches.install import table

    out = subprocess.run([sys.executable, "-m", "stapo_cpu.patches"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout == table(), out.stderr[-2000:]
    assert (REPO / "docs" / "cpu_patches.md").read_text() == table(), \
        "docs/cpu_patches.md is stale: python -m stapo_cpu.patches > docs/cpu_patches.md"
