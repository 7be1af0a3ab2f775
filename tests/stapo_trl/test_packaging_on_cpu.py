"""The ``trl`` extra (pyproject.toml): TRL pinned, installed at that pin, and its requirements met
by the CPU stack's own pins, so installing the extra changes no pin of the verl path."""

from __future__ import annotations

import importlib.metadata
import re

from packaging.requirements import Requirement
from tests.helpers.paths import REPO


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_trl_extra_pins_the_installed_trl():
    text = (REPO / "pyproject.toml").read_text()  # read as text: tomllib is Python 3.11+
    extras = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    line = re.search(r"^trl = \[(.*)\]$", extras, flags=re.M)
    assert line, "no trl extra under [project.optional-dependencies] in pyproject.toml"
    extra = [Requirement(r.strip().strip('"')) for r in line.group(1).split(",") if r.strip()]
    assert [r.name for r in extra] == ["trl"]
    (pin,) = extra[0].specifier
    assert pin.operator == "==" and importlib.metadata.version("trl") == pin.version
    include = re.search(r"^include = \[(.*)\]$", text.split("[tool.setuptools.packages.find]", 1)[1], flags=re.M)
    assert include and '"stapo_trl*"' in include.group(1)


def test_trls_requirements_are_met_by_the_cpu_pins():
    pins = {}
    for line in (REPO / "requirements-cpu.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            req = Requirement(line)
            pins[_norm(req.name)] = next(iter(req.specifier)).version
    checked = []
    for line in importlib.metadata.requires("trl") or []:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker):
            continue
        name = _norm(req.name)
        if name in pins:
            assert req.specifier.contains(pins[name], prereleases=True), f"trl requires {req}, requirements-cpu.txt pins {pins[name]}"
            checked.append(name)
        installed = importlib.metadata.version(req.name)
        assert req.specifier.contains(installed, prereleases=True), f"trl requires {req}, installed {installed}"
    assert "transformers" in checked
