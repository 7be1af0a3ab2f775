"""``requirements.txt`` (the GPU stack) agrees with verl 0.9.1's own pins, read from the installed
verl's metadata: its ``vllm`` extra (torch, vllm, transformers...) and its flash-attn extra."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.requirements import Requirement
from tests.helpers.paths import REPO

#: ``name==version`` anywhere in the file, comments included (flash-attn is installed as its own step)
PIN = re.compile(r"(?<![\w.-])([A-Za-z0-9][A-Za-z0-9_.-]*)(?:\[[^\]]*\])?==([0-9][\w.+!-]*)")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def our_pins() -> dict[str, str]:
    return {_norm(n): v for n, v in PIN.findall((REPO / "requirements.txt").read_text())}


def verl_pins(extra_prefix: str) -> dict[str, str]:
    """``name -> version`` of verl's exact pins in the extras whose name starts with ``extra_prefix``."""
    pins = {}
    for line in importlib.metadata.requires("verl") or []:
        req = Requirement(line)
        extras = re.findall(r'extra == "([^"]+)"', str(req.marker or ""))
        specs = list(req.specifier)
        if any(e.startswith(extra_prefix) for e in extras) and len(specs) == 1 and specs[0].operator == "==":
            pins[_norm(req.name)] = specs[0].version
    return pins


def test_verl_version_is_the_one_the_recipe_targets():
    assert importlib.metadata.version("verl") == our_pins()["verl"] == "0.9.1"


def test_requirements_pin_what_verls_vllm_extra_pins():
    theirs = verl_pins("vllm")
    assert {"torch", "vllm", "transformers"} <= set(theirs), theirs
    ours = our_pins()
    missing = sorted(set(theirs) - set(ours))
    differ = {k: (ours[k], theirs[k]) for k in theirs if k in ours and ours[k] != theirs[k]}
    assert not missing, f"requirements.txt does not pin {missing} (verl[vllm] pins {theirs})"
    assert not differ, f"requirements.txt disagrees with verl[vllm]: (ours, verl's) {differ}"


def test_flash_attn_step_matches_verls_flash_attn_extra():
    theirs = verl_pins("flash-attn")
    assert "flash-attn" in theirs, theirs
    assert our_pins().get("flash-attn") == theirs["flash-attn"]
    text = (REPO / "requirements.txt").read_text()
    # its own step, never a plain requirement line (pip's isolated build has no torch)
    assert not re.search(r"^flash[-_]attn", text, flags=re.M)
    assert re.search(r"pip install flash-attn==\S+ --no-build-isolation", text)


def test_python_range_stated_matches_verls():
    requires_python = importlib.metadata.metadata("verl")["Requires-Python"]
    assert "<3.13" in requires_python
    assert "Python 3.10-3.12" in (REPO / "requirements.txt").read_text()
