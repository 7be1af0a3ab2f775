"""The patch table (verl_patches.install.PATCHES), its wrap-once helper (verl_patches.registry) and its
check against a verl's source (``python -m verl_patches check [VERL_SOURCE]``: the installed verl, a copy
with one anchor gone, one def line changed, one upstream fix); the CPU wing's table
(stapo_cpu.patches.install.PATCHES) stays out of it.

Which patches are in place is process-global state, so it is probed in fresh interpreters.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.helpers.anchors import anchor_problem
from tests.helpers.paths import REPO


PROBE = textwrap.dedent(
    """
    import json, sys
    import verl
    import verl_patches.activate
    from verl_patches.install import PATCHES, install
    from verl_patches.registry import apply, applies_here, is_applied, original_of, _owner_and_attr
    wing = sorted(m for m in sys.modules if m.split(".")[0] == "stapo_cpu")
    # the targets in verl's vLLM rollout import only where a 'vllm' distribution answers verl's version
    # lookup: a GPU install has it; this CPU environment has vLLM's CPU build, for which the CPU wing's
    # entry answers (applied by hand, after the wing's absence was recorded)
    from stapo_cpu.patches.install import PATCHES as WING
    (version,) = [p for p in WING if p.name == "vllm_cpu_build_version"]
    apply(version)
    state = {}
    def attrs():
        out = {}
        for p in PATCHES:
            if p.kind == "wrap":
                owner, attr = _owner_and_attr(p.target)
                out[p.name] = id(getattr(owner, attr))
        return out
    def home(obj):
        obj = getattr(obj, "_function", obj)  # a ray.remote function: the function it runs
        name = obj.__name__ if isinstance(obj, type(json)) else getattr(obj, "__module__", "") or ""
        return name.split(".")[0]
    before = attrs()
    again = install()
    print(json.dumps({
        "wing_modules": wing,
        "applied": {p.name: is_applied(p) for p in PATCHES},
        "applies": {p.name: applies_here(p) for p in PATCHES},
        "wing_applied": [p.name for p in WING if p is not version and is_applied(p)],
        "second_install": again,
        "unchanged_by_second_install": attrs() == before,
        "originals": {p.name: home(original_of(getattr(*_owner_and_attr(p.target))))
                      for p in PATCHES if p.kind == "wrap" and is_applied(p)},
    }))
    """
)


def _probe(**env_overrides: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(env_overrides)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


IMPORT_EVERYTHING_ELSE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    package, table = sys.argv[1], sys.argv[2]
    names = sorted(m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__, package + ".")
                   if not m.name.endswith((".activate", ".__main__")))
    for name in names:
        importlib.import_module(name)
    from verl_patches.registry import _HOOKS, is_applied
    patches = importlib.import_module(table).PATCHES
    loaded = [p for p in patches if p.target.partition(":")[0] in sys.modules]
    print(json.dumps({"imported": names, "hooks": _HOOKS in sys.meta_path,
                      "applied": [p.name for p in loaded if is_applied(p)]}))
    """
)


@pytest.mark.parametrize("package, table, some", [
    ("verl_patches", "verl_patches.install", {"verl_patches.install", "verl_patches.weight_sync"}),
    ("stapo_cpu.patches", "stapo_cpu.patches.install", {"stapo_cpu.patches.install", "stapo_cpu.patches.vllm_cpu"}),
])
def test_only_the_activate_modules_apply_anything(package, table, some):
    """Importing every other module of verl_patches, or of the CPU wing's patches (on the CPU path,
    where the most would apply), applies no patch and leaves no import hook: a process that only needs a
    helper (vLLM's plugin off the CPU path, the wing's clean-up) gets nothing else."""
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES",)}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), VERL_PLATFORM="cpu")
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING_ELSE, package, table], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    probed = json.loads(out.stdout.strip().splitlines()[-1])
    assert some <= set(probed["imported"]), probed["imported"]
    assert not probed["hooks"] and probed["applied"] == [], probed


def test_every_patch_is_applied_once_and_a_gpu_process_loads_nothing_of_the_cpu_wing():
    """A process with VERL_PLATFORM unset (a GPU run's) that imports verl and ``verl_patches.activate``
    has no module of the CPU wing loaded and applied every core patch and none of the wing's; a second
    install changes nothing, and each wrap leads back to verl's own."""
    from verl_patches.install import PATCHES

    probed = _probe()
    assert probed["wing_modules"] == [], probed["wing_modules"]
    assert probed["wing_applied"] == [], probed["wing_applied"]
    assert all(probed["applies"].values()) and probed["applied"] == {p.name: True for p in PATCHES}, probed["applied"]
    assert probed["second_install"] == [] and probed["unchanged_by_second_install"]
    assert probed["originals"] and set(probed["originals"].values()) == {"verl"}, probed["originals"]


def test_apply_wraps_once_and_keeps_the_original():
    """The wrap-once helper on a throwaway module: applied once, marked, original reachable."""
    import types

    from verl_patches.registry import MARKER, Patch, apply, is_applied, original_of

    module = types.ModuleType("stapo_registry_probe")
    module.double = lambda x: 2 * x
    sys.modules[module.__name__] = module
    wrappers = types.ModuleType("stapo_registry_wrappers")
    calls = []

    def plus_one(original):
        calls.append(original)
        return lambda x: original(x) + 1

    wrappers.plus_one = plus_one
    sys.modules[wrappers.__name__] = wrappers
    try:
        patch = Patch(name="probe", target="stapo_registry_probe:double", wrapper="stapo_registry_wrappers:plus_one",
                      changes="c", why="w", relies_on="r", drop_when="d")
        own = module.double
        assert not is_applied(patch)
        assert apply(patch) is True and apply(patch) is False and len(calls) == 1
        assert module.double(3) == 7 and getattr(module.double, MARKER) == "probe"
        assert original_of(module.double) is own and is_applied(patch)
    finally:
        del sys.modules[module.__name__], sys.modules[wrappers.__name__]


def test_a_wrap_waits_for_its_module(tmp_path):
    """A wrap is applied when its target's module is first imported (also through a
    ``from module import name`` that binds the name at once), and at once when it already is."""
    (tmp_path / "stapo_late_probe.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "stapo_late_user.py").write_text("from stapo_late_probe import double\n")
    (tmp_path / "stapo_late_wrappers.py").write_text(
        "def plus_one(original):\n    return lambda x: original(x) + 1\n")
    code = textwrap.dedent("""
        import sys
        from verl_patches.registry import Patch, apply_on_import, is_applied
        patch = Patch(name="late", target="stapo_late_probe:double", wrapper="stapo_late_wrappers:plus_one",
                      changes="c", why="w", relies_on="r", drop_when="d")
        assert apply_on_import(patch) is False and "stapo_late_probe" not in sys.modules
        import stapo_late_user
        assert stapo_late_user.double(3) == 7, "the importer bound the unpatched function"
        assert is_applied(patch) and apply_on_import(patch) is False
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("kwargs,match", [
    (dict(wrapper="a:b", register="a:c", registered="a:d"), "exactly one of"),
    (dict(), "exactly one of"),
    (dict(register="a:c"), "registered="),
    (dict(wrapper="a:b", target="no_colon"), "module:attribute"),
])
def test_a_malformed_patch_is_refused(kwargs, match):
    from verl_patches.registry import Patch

    fields = dict(name="p", target="m:x", changes="c", why="w", relies_on="r", drop_when="d")
    fields.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Patch(**fields)


def test_every_reference_in_the_table_resolves():
    """Targets, wrappers, registrations and conditions all name existing objects in verl 0.9.1, and
    every entry says what, why, what it relies on (its anchors first the ``def`` line of the function it
    wraps) and when to drop it (verl's vLLM rollout imports in this process: tests/conftest.py)."""
    from verl_patches.install import PATCHES
    from verl_patches.registry import _owner_and_attr, resolve

    names = [p.name for p in PATCHES]
    assert len(names) == len(set(names))
    for patch in PATCHES:
        for ref in (patch.wrapper, patch.register, patch.registered, patch.applies):
            if ref is not None:
                assert callable(resolve(ref)), f"{patch.name}: {ref}"
        owner, attr = _owner_and_attr(patch.target)
        assert hasattr(owner, attr) or patch.kind == "register", patch.target
        assert all(len(text) > 10 for text in (patch.changes, patch.why, patch.relies_on, patch.drop_when))
        assert anchor_problem(patch) is None, anchor_problem(patch)  # what python -m verl_patches check reads


def test_docs_table_matches_the_code():
    from verl_patches.install import table

    assert (REPO / "docs" / "verl_patches.md").read_text() == table(), \
        "docs/verl_patches.md is stale: python -m verl_patches > docs/verl_patches.md"


def test_python_m_verl_patches_lists_the_core_table_and_nothing_of_the_cpu_wing():
    """The printed table's entries are the core table's, in its order; none is the CPU wing's."""
    from stapo_cpu.patches.install import PATCHES as WING
    from verl_patches.install import PATCHES

    out = subprocess.run([sys.executable, "-m", "verl_patches"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    listed = re.findall(r"^## `([^`]+)`$", out.stdout, flags=re.M)
    assert listed == [p.name for p in PATCHES] and len(listed) == len(set(listed))
    assert not set(listed) & {p.name for p in WING} and "stapo_cpu" not in out.stdout


def test_other_verl_versions_are_refused_unless_allowed():
    from verl_patches.registry import VERL_VERSION, VERSION_OVERRIDE_ENV, check_verl_version

    warnings = []
    assert check_verl_version(VERL_VERSION, environ={}, warn=warnings.append) == VERL_VERSION and not warnings
    with pytest.raises(RuntimeError, match=rf"verl 0\.9\.2 is installed.*pip install verl=={VERL_VERSION}.*"
                                           rf"python -m verl_patches check.*{VERSION_OVERRIDE_ENV}=0\.9\.2"):
        check_verl_version("0.9.2", environ={})
    with pytest.raises(RuntimeError):  # an override for another version does not count
        check_verl_version("0.9.2", environ={VERSION_OVERRIDE_ENV: "0.10.0"})
    for allowed in ("0.9.2", "any"):
        assert check_verl_version("0.9.2", environ={VERSION_OVERRIDE_ENV: allowed}, warn=warnings.append) == "0.9.2"
    assert len(warnings) == 2 and all("python -m verl_patches check" in w for w in warnings)


def test_importing_the_patches_on_another_verl_fails_clearly():
    """A fresh interpreter whose verl reports another version refuses ``import verl_patches.activate``."""
    code = textwrap.dedent("""
        import importlib.metadata as md
        real = md.version
        md.version = lambda name: "0.8.0" if name == "verl" else real(name)
        try:
            import verl_patches.activate
        except RuntimeError as exc:
            print("refused:", exc)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "STAPO_ALLOW_VERL_VERSION")}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "refused: verl_patches: the recipe patches verl 0.9.1, but verl 0.8.0 is installed" in out.stdout, \
        out.stderr[-2000:]


def _check(package: str, *args: str) -> tuple[int, list[str], str]:
    out = subprocess.run([sys.executable, "-m", package, "check", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    return out.returncode, out.stdout.splitlines(), out.stderr


def test_every_entry_applies_to_the_installed_verl():
    """``python -m verl_patches check`` finds every anchor in the installed verl 0.9.1: one
    ``applies`` line per entry, in the table's order, exit 0."""
    from verl_patches.install import PATCHES

    rc, lines, err = _check("verl_patches")
    assert rc == 0, lines + [err]
    assert lines == [f"applies  {p.name}" for p in PATCHES] + ["15 apply, 0 break, 0 obsolete (verl: installed)"]


def test_the_core_check_reads_sources_and_imports_neither_verl_nor_a_wing():
    """The core's check reads verl's files as text: the process imports no verl, torch or vLLM, and no
    module of either wing."""
    code = textwrap.dedent("""
        import json, runpy, sys
        sys.argv = ["verl_patches", "check"]
        try:
            runpy.run_module("verl_patches", run_name="__main__")
        except SystemExit as exc:
            status = exc.code
        loaded = sorted({m.split(".")[0] for m in sys.modules} & {"verl", "torch", "vllm", "stapo_cpu", "stapo_memory"})
        print(json.dumps({"status": status, "loaded": loaded}))
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"status": 0, "loaded": []}, out.stderr[-2000:]


@pytest.fixture(scope="module")
def verl_copy(tmp_path_factory):
    """A copy of the installed verl's source tree, as a checkout holds it: ``<copy>/verl/...``."""
    import importlib.util
    import shutil

    root = tmp_path_factory.mktemp("verl_checkout")
    (installed,) = importlib.util.find_spec("verl").submodule_search_locations
    shutil.copytree(installed, root / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("file, old, new, expected", [
    # an anchor gone: the mini-batch hook's call site
    ("workers/engine_workers.py", "actor_output = self.train_batch(mini_batch_td)",
     "actor_output = self.run_batch(mini_batch_td)",
     ["breaks   mini_batch_fold: 'actor_output = self.train_batch(mini_batch_td)' not in "
      "verl/workers/engine_workers.py"]),
    # a changed def line: the v1 trainer's old-log-prob pass takes another parameter
    ("trainer/ppo/v1/trainer_base.py", "def _compute_old_log_prob(self, batch: KVBatchMeta, metrics: dict)",
     "def _compute_old_log_prob(self, batch: KVBatchMeta, metrics: dict, timing: dict)",
     ["breaks   v1_old_log_prob_stats: 'def _compute_old_log_prob(self, batch: KVBatchMeta, metrics: dict)' not in "
      "verl/trainer/ppo/v1/trainer_base.py"]),
    # upstream's own fix: the weight sync's socket bounded by verl
    ("workers/rollout/vllm_rollout/bucketed_weight_transfer.py", "self.socket.bind(self.zmq_handle)",
     "self.socket.setsockopt(zmq.RCVTIMEO, 60000)\n        self.socket.bind(self.zmq_handle)",
     [f"obsolete {name}: upstream has 'zmq.RCVTIMEO' (verl bounds the weight sync's waits)"
      for name in ("weight_sync_timeout", "weight_sync_timeout_error")]),
])
def test_the_check_names_what_a_changed_verl_breaks(verl_copy, file, old, new, expected):
    """``python -m verl_patches check VERL_SOURCE`` on a copy of verl 0.9.1 with one change: the entries
    it concerns are reported (the missing anchor, the changed def line, the upstream fix), every other
    entry applies, and the exit status is 1."""
    path = verl_copy / "verl" / file
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    try:
        rc, lines, err = _check("verl_patches", str(verl_copy))
    finally:
        path.write_text(text)
    assert rc == 1, lines + [err]
    assert [line for line in lines[:-1] if not line.startswith("applies ")] == expected
    assert len(lines) == 15 + 1 and lines[-1].endswith(f"(verl: {verl_copy})")
    rc, lines, _ = _check("verl_patches", str(verl_copy))  # the copy unchanged: every entry applies
    assert rc == 0 and lines[-1].startswith("15 apply, 0 break, 0 obsolete")


def test_the_check_refuses_a_folder_without_verl(tmp_path):
    rc, lines, err = _check("verl_patches", str(tmp_path))
    assert rc == 2 and not lines and f"no verl source tree in {str(tmp_path)!r}" in err
    out = subprocess.run([sys.executable, "-m", "verl_patches", "verify"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "usage: python -m verl_patches [check [VERL_SOURCE]]" in out.stderr


def test_the_check_reads_a_file_with_a_stray_byte_and_refuses_a_name_too_long(verl_copy, capsys):
    """A byte that is not UTF-8 in a file the anchors are looked up in was a UnicodeDecodeError
    traceback (the anchors are ASCII: it is no reason to fail); a VERL_SOURCE longer than the system
    takes, an OSError traceback."""
    from verl_patches.install import PATCHES, table
    from verl_patches.registry import main

    path = verl_copy / "verl" / "trainer" / "ppo" / "ray_trainer.py"  # a patch's target
    text = path.read_bytes()
    path.write_bytes(text + b"\n# \xff\xfe\n")
    try:
        assert main(PATCHES, table, "python -m verl_patches", ["check", str(verl_copy)]) == 0
    finally:
        path.write_bytes(text)
    assert capsys.readouterr().out.splitlines()[-1].startswith("15 apply, 0 break, 0 obsolete")
    assert main(PATCHES, table, "python -m verl_patches", ["check", "x" * 300]) == 2
    assert f"no verl source tree in {'x' * 300!r}" in capsys.readouterr().err
