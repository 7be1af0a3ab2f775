"""vLLM's plugin for the CPU path (stapo_cpu/patches/vllm_plugin.py): vLLM loads its plugins in each of
its processes, so off the CPU path loading them must import neither verl nor the recipe and change
nothing; on it, the CPU wing's patches vLLM's processes need are in place once they are loaded, and the
core's table after them. Only the CPU environment registers the plugin (its own distribution,
stapo_cpu/patches/vllm_plugin_dist/).

vLLM's engine core loads the plugins when it starts (vllm/v1/engine/core.py): what a fresh interpreter
gets from ``load_general_plugins()`` here is what it gets. The whole rollout, every vLLM process
running the pinned kernels, is tests/e2e/test_vllm_rollout_e2e_on_cpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import distribution, entry_points

from tests.helpers.paths import REPO

PLUGIN_DIST = REPO / "stapo_cpu" / "patches" / "vllm_plugin_dist"
#: a variable only the secrets file sets
SECRET = "STAPO_TEST_PLUGIN_SECRET"

LOAD = textwrap.dedent("""
    import importlib.metadata, json, os, sys
    before = set(sys.modules)
    from vllm.plugins import load_general_plugins
    import torch
    loaded_by_vllm = set(sys.modules) - before
    load_general_plugins()
    new = sorted(set(sys.modules) - before - loaded_by_vllm)
    ours = [m for m in new if m.split(".")[0] in ("verl", "verl_patches", "recipe", "stapo_core", "stapo_trl",
                                                  "stapo_cpu")]
    out = {
        "new_modules": ours,
        "hooks": [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("verl_patches")],
        "order": [m for m in sys.modules if m in ("stapo_cpu.activate", "verl_patches.activate")],  # import order
        "wrapped": [f.__stapo_patch__ for f in (importlib.metadata.version, torch.cpu.get_capabilities)
                    if hasattr(f, "__stapo_patch__")],
        "secret_read": os.environ.get(sys.argv[1]),
        "socket_folder": os.path.isdir(sys.argv[2]),
    }
    if "stapo_cpu.patches.install" in sys.modules:
        from stapo_cpu.patches.install import PATCHES
        from verl_patches.registry import applies_here, is_applied
        import vllm.model_executor.layers.utils as layer_utils
        out["cpu_patches"] = {p.name: is_applied(p) for p in PATCHES if applies_here(p)}
        out["gemm"] = getattr(layer_utils.dispatch_cpu_unquantized_gemm, "__stapo_patch__", None)
    print(json.dumps(out))
""")


def _load_plugins(tmp_path, **env_overrides: str) -> dict:
    """``load_general_plugins()`` in a fresh interpreter with the recipe on the path, a secrets file
    and a socket folder that does not exist yet; VERL_PLATFORM and VERL_USE_EXTERNAL_MODULES unset,
    then ``env_overrides``."""
    secrets = tmp_path / "secrets.env"
    secrets.write_text(f"{SECRET}=from-the-file\n")
    secrets.chmod(0o600)
    folder = tmp_path / "sockets"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES", "VLLM_PLUGINS", SECRET)}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), VLLM_TARGET_DEVICE="cpu",
               STAPO_SECRETS_FILE=str(secrets), VLLM_RPC_BASE_PATH=str(folder), **env_overrides)
    out = subprocess.run([sys.executable, "-c", LOAD, SECRET, str(folder)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_off_the_cpu_path_loading_vllms_plugins_imports_and_applies_nothing(tmp_path):
    """Any vLLM process (a GPU run's engines, an evaluation, another program's script) in an
    environment where the plugin is installed: it resolves to two small modules and returns."""
    probed = _load_plugins(tmp_path)
    assert "stapo_cpu.patches.vllm_plugin" in probed["new_modules"], "the plugin was not loaded: is it installed?"
    assert set(probed["new_modules"]) <= {"stapo_cpu", "stapo_cpu.patches", "stapo_cpu.patches.selection",
                                          "stapo_cpu.patches.vllm_plugin"}, probed["new_modules"]
    assert not probed["hooks"] and not probed["wrapped"], probed
    assert probed["secret_read"] is None and not probed["socket_folder"]
    assert "cpu_patches" not in probed  # the patch table was never imported


def test_on_the_cpu_path_the_plugin_applies_the_cpu_patches_vllm_needs(tmp_path):
    probed = _load_plugins(tmp_path, VERL_PLATFORM="cpu", ATEN_CPU_CAPABILITY="avx2")
    assert probed["order"] == ["stapo_cpu.activate", "verl_patches.activate"]  # the wing's table, then the core's
    assert probed["cpu_patches"] and all(probed["cpu_patches"].values()), probed["cpu_patches"]
    # before vLLM loads its kernels: the instruction-set pin; once vLLM's layers are imported: the GEMM's
    assert "cpu_vllm_isa_pin" in probed["wrapped"] and probed["gemm"] == "cpu_vllm_keep_linear_weight"
    assert probed["secret_read"] == "from-the-file" and probed["socket_folder"]


def test_only_the_cpu_environment_registers_the_plugin():
    """The recipe's distribution declares no vLLM plugin (a GPU install, ``pip install -e .``, has
    none); the plugin's own distribution declares it, and this environment (run_scripts/_venv.sh)
    has it from there."""
    recipe = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    plugin = tomllib.loads((PLUGIN_DIST / "pyproject.toml").read_text())
    assert "entry-points" not in recipe and "scripts" not in recipe
    assert plugin["project"]["entry-points"] == {"vllm.general_plugins": {"stapo_cpu": "stapo_cpu.patches.vllm_plugin:load"}}
    assert plugin["tool"]["setuptools"]["packages"] == []  # metadata only: the code is the recipe's
    installed = {ep.name: (ep.value, ep.dist.name) for ep in entry_points(group="vllm.general_plugins")}
    assert not [ep for ep in distribution("stapo-recipe").entry_points], \
        "the installed stapo-recipe still declares entry points: reinstall it (bash run_scripts/_venv.sh)"
    assert installed.get("stapo_cpu") == ("stapo_cpu.patches.vllm_plugin:load", "stapo-cpu-vllm-plugin"), \
        f"vLLM's plugins here: {installed}; install the CPU path's (bash run_scripts/_venv.sh)"
