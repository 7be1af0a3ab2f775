"""The project's import graph: stapo_core <- verl_patches <- recipe, and stapo_core <- stapo_trl (the
TRL adapter, beside the verl layers: neither imports the other); two wings on top of the core, which
imports neither: the CPU path stapo_cpu and the GPU memory planner stapo_memory; no cycles between
modules or between folders, thin __init__ files.

Read from the source with ``ast`` (every import, at module level or inside a function), so the test
needs no import side effect and fails on the first upward import anyone adds.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from tests.helpers.paths import REPO

#: each layer and the project layers it may import (besides itself)
ALLOWED = {
    "stapo_core": set(),
    "verl_patches": {"stapo_core"},
    "recipe": {"stapo_core", "verl_patches"},
    "stapo_cpu": {"stapo_core", "verl_patches", "recipe"},  # the CPU wing: on top of the core, beside stapo_trl
    "stapo_memory": {"stapo_core", "verl_patches", "recipe"},  # the preflight names its check as data
    "benchmarks": {"stapo_core", "verl_patches", "recipe", "stapo_trl", "stapo_cpu", "stapo_memory"},  # on top of every side
    "stapo_trl": {"stapo_core"},
}
FORBIDDEN_THIRD_PARTY = {
    "stapo_core": {"verl", "ray", "transformers", "hydra", "omegaconf", "trl", "accelerate"},
    "stapo_trl": {"verl", "ray", "hydra", "omegaconf"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, top_level_only: bool = False) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved); with
    ``top_level_only``, only the imports run when the module is imported."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in (tree.body if top_level_only else ast.walk(tree)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}  # `from pkg import submodule`
    return names


def sources(layer: str) -> list[Path]:
    return sorted(p for p in (REPO / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_flow_one_way(layer):
    others = set(ALLOWED) - {layer} - ALLOWED[layer]
    bad = [f"{p.relative_to(REPO)} imports {name}" for p in sources(layer) for name in sorted(imports_of(p))
           if name.split(".")[0] in others | FORBIDDEN_THIRD_PARTY.get(layer, set())]
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    """Imports between the project's own modules (lazy ones inside functions too) form no cycle."""
    modules = {module_name(p): p for layer in ALLOWED for p in sources(layer)}
    graph = {}
    for name, path in modules.items():
        deps = imports_of(path)
        # a package's own __init__ is not a dependency of its submodules
        graph[name] = {d for d in deps if d in modules and d != name and not name.startswith(d + ".")}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_no_import_cycles_between_folders():
    """Between folders (packages) the imports flow one way: two folders never import each other, through
    any chain of modules (a folder's imports of its own parents and subfolders are left out)."""
    modules = {module_name(p): p for layer in ALLOWED for p in sources(layer)}

    def folder(name: str) -> str:
        return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = folder(name)
        for dep in (folder(d) for d in imports_of(path) if d in modules):
            if dep != here and not dep.startswith(here + ".") and not here.startswith(dep + "."):
                graph.setdefault(here, set()).add(dep)

    def reached(start: str) -> dict[str, list[str]]:
        paths, todo = {start: [start]}, [start]
        while todo:
            node = todo.pop()
            for dep in sorted(graph.get(node, ())):
                if dep not in paths:
                    paths[dep] = paths[node] + [dep]
                    todo.append(dep)
        return paths

    for start in sorted(graph):
        back = [dep for dep in sorted(graph[start]) if start in reached(dep)]
        assert not back, f"folder import cycle: {start} -> " + " -> ".join(reached(back[0])[start])


def test_init_files_hold_no_logic():
    """``__init__.py`` files re-export (and the two documented import-time switches); no definitions."""
    for layer in ALLOWED:
        for path in (REPO / layer).rglob("__init__.py"):
            tree = ast.parse(path.read_text())
            defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
            assert not defs, f"{path.relative_to(REPO)} defines {defs}: move them to a module"


def test_readme_layout_table_matches_the_tree():
    """Every folder the README's layout table lists exists, and every top-level folder of the
    project (besides hidden ones and generated outputs) is listed."""
    import re

    readme = (REPO / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([^`]+)/` \|", section, flags=re.M))
    assert listed, "no layout table in README.md"
    assert all((REPO / name).is_dir() for name in listed), sorted(n for n in listed if not (REPO / n).is_dir())
    ignored = {"assets", "results", "outputs", "checkpoints", "data"}
    tracked = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name not in ignored
               and not p.name.endswith(".egg-info") and p.name != "__pycache__"}
    assert tracked <= {n.split("/")[0] for n in listed}, sorted(tracked - {n.split("/")[0] for n in listed})


def _comments(line: str) -> list[str]:
    """The comment of a source line (a trailing one too), ``noqa``/``type:`` markers left out."""
    code, sep, comment = line.partition("#")
    if not sep or code.count('"') % 2 or code.count("'") % 2:  # no comment, or a '#' inside a string
        return []
    text = comment.strip()
    return [] if not text or text.startswith(("noqa", "type:")) else [text]


def unexplained_local_imports(path: Path) -> list[int]:
    """Line numbers of the imports inside functions of ``path`` without a reason: a comment on the
    import's lines, or in the run of comment and import lines right above it."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines), filename=str(path))
    bad = []
    for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(func):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if any(_comments(lines[i]) for i in range(node.lineno - 1, node.end_lineno)):
                continue
            above = node.lineno - 2
            explained = False
            while above >= 0 and lines[above].strip().startswith(("#", "import ", "from ")):
                if _comments(lines[above]):
                    explained = True
                    break
                above -= 1
            if not explained:
                bad.append(node.lineno)
    return bad


def _checked_sources() -> list[Path]:
    return [p for layer in ("stapo_core", "stapo_trl", "verl_patches", "recipe", "stapo_cpu", "stapo_memory")
            for p in sources(layer)]


def test_every_function_level_import_says_why():
    """Imports belong at the module top; one kept inside a function (verl only after
    VERL_USE_EXTERNAL_MODULES is set, an optional or slow dependency kept out of --help, a cycle)
    carries a comment saying which."""
    bad = [f"{p.relative_to(REPO)}:{n}" for p in _checked_sources() for n in unexplained_local_imports(p)]
    assert not bad, "imports inside functions without a reason comment:\n" + "\n".join(bad)


def test_unexplained_imports_are_found(tmp_path):
    """The check above sees an unexplained import (a ``noqa`` is no reason), a trailing reason, and a
    reason above a block of imports."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    import json\n\n"
                     "def g():\n    import json  # why\n\n"
                     "def h():\n    # why, for both\n    import json\n    from os import path\n\n"
                     "def k():\n    import json  # noqa: F401\n")
    assert unexplained_local_imports(probe) == [2, 13]


#: what belongs to the CPU path (vLLM on a CPU, its socket folder, /dev/shm clean-up, the platform switch)
CPU_PATH_WORDS = re.compile(r"vllm|/dev/shm|\bshm|semaphore|socket|scratch|VERL_PLATFORM|cpu path|cpu_", re.I)


def test_the_cpu_path_stays_out_of_where_a_gpu_reader_starts():
    """The Hydra entry point names no CPU at all, and stapo_core (torch's ``.cpu()`` and gloo's CPU
    tensors aside) nothing of the CPU path: it lives in the CPU wing, stapo_cpu/, behind
    ``VERL_PLATFORM=cpu``."""
    entry = REPO / "recipe" / "stapo" / "main_stapo.py"
    found = [f"{entry.relative_to(REPO)}:{n}" for n, line in enumerate(entry.read_text().splitlines(), 1)
             if re.search(r"cpu", line, re.I) or CPU_PATH_WORDS.search(line)]
    found += [f"{p.relative_to(REPO)}:{n}" for p in sources("stapo_core")
              for n, line in enumerate(p.read_text().splitlines(), 1) if CPU_PATH_WORDS.search(line)]
    assert not found, "the CPU path named where a GPU reader starts:\n" + "\n".join(found)


def test_no_core_layer_names_the_cpu_wing():
    """The core (stapo_core, verl_patches, recipe) imports nothing of ``stapo_cpu``, at module level or
    inside a function, and names no module of it in a string either (an ``importlib`` call, an
    environment default): the wing plugs in only through ``VERL_USE_EXTERNAL_MODULES`` and vLLM's
    plugin entry point, which only the CPU environment sets."""
    core = [p for layer in ("stapo_core", "verl_patches", "recipe") for p in sources(layer)]
    found = [f"{p.relative_to(REPO)}:{n}" for p in core for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"\bstapo_cpu\.\w", line)]
    found += [f"{p.relative_to(REPO)} imports {name}" for p in core for name in sorted(imports_of(p))
              if name.split(".")[0] == "stapo_cpu"]
    assert not found, "the core names the CPU wing:\n" + "\n".join(found)


def test_nothing_imports_the_bare_verl_patches_package():
    """``verl_patches`` itself applies nothing; the patch table is applied by importing
    ``verl_patches.activate`` (code that imports the bare package for its patches gets none)."""
    bare = re.compile(r"^\s*import verl_patches\s*(#.*)?$", re.M)
    files = [p for layer in (*ALLOWED, "tests") for p in (REPO / layer).rglob("*.py")]
    found = [str(p.relative_to(REPO)) for p in files if bare.search(p.read_text())]
    assert not found, "`import verl_patches` applies nothing, use `import verl_patches.activate`:\n" + "\n".join(found)


def test_the_front_door_and_every_module_stay_small():
    """README.md is a front door of at most 140 lines (the rest lives in docs/), and no tracked Python
    module outside tests/ reaches 800 lines (a module that long is two modules)."""
    import subprocess

    assert len((REPO / "README.md").read_text().splitlines()) <= 140
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    lengths = {path: len((REPO / path).read_text().splitlines()) for path in tracked.stdout.split()
               if not path.startswith("tests/")}
    assert lengths and all(n <= 800 for n in lengths.values()), {p: n for p, n in lengths.items() if n > 800}
