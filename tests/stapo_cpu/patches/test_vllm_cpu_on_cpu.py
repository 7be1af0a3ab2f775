"""The CPU path's changes to vLLM and to verl's view of it (stapo_cpu/patches/vllm_cpu.py), each
against vLLM's own function or the behaviour it cures. The whole rollout runs in
tests/e2e/test_vllm_rollout_e2e_on_cpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from importlib.metadata import PackageNotFoundError
from multiprocessing import shared_memory
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from recipe.stapo.eval.shm import SHM_DIR
from stapo_cpu.patches import vllm_cpu
from tests.helpers.paths import REPO
# the /dev/shm test helpers: a process holding (or leaving) a named semaphore, a file's removal after the test
from tests.recipe.eval.test_shm_on_cpu import SEMAPHORE, _semaphore, _start, cleanup  # noqa: F401


def test_the_version_lookup_answers_vllm_with_the_cpu_build():
    installed = {"vllm-cpu": "0.31.0", "torch": "2.13.0"}

    def version(name):
        if name not in installed:
            raise PackageNotFoundError(name)
        return installed[name]

    wrapped = vllm_cpu.wrap_metadata_version(version)
    assert wrapped("vllm") == "0.31.0" and wrapped("torch") == "2.13.0"
    with pytest.raises(PackageNotFoundError, match="sglang"):
        wrapped("sglang")
    installed["vllm"] = "0.24.0"  # a real vLLM wins
    assert wrapped("vllm") == "0.24.0"
    del installed["vllm"], installed["vllm-cpu"]
    with pytest.raises(PackageNotFoundError, match="'?vllm'?$"):  # the error names what verl asked for
        wrapped("vllm")


def test_the_cpu_build_is_what_this_environment_has():
    """The CPU requirements install vllm-cpu (verl's vLLM rollout needs the version patch here)."""
    assert vllm_cpu.cpu_build_only()


PACKED_LINEAR = textwrap.dedent("""
    import json, torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from stapo_cpu.patches.vllm_cpu import wrap_dispatch_cpu_unquantized_gemm
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    out = {}
    for name, dispatch in (("vllm", dispatch_cpu_unquantized_gemm),
                           ("patched", wrap_dispatch_cpu_unquantized_gemm(dispatch_cpu_unquantized_gemm))):
        layer = torch.nn.Linear(64, 96, bias=False)
        reference = torch.nn.functional.linear(x, layer.weight).detach()
        dispatch(layer, remove_weight=True)  # what vLLM's linear layers ask for
        y = layer.cpu_linear(x, layer.weight, None)
        out[name] = {"weight_shape": list(layer.weight.shape), "max_err": float((y - reference).abs().max())}
    print(json.dumps(out))
""")


def test_vllms_cpu_gemm_keeps_the_weight_verls_sync_writes_into():
    """vLLM's own dispatch drops ``layer.weight`` (verl's weight sync then fails); the patched one keeps
    it, and both compute the same linear map."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PACKED_LINEAR], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["vllm"]["weight_shape"] == [0] and result["patched"]["weight_shape"] == [96, 64], result
    assert result["vllm"]["max_err"] < 1e-4 and result["patched"]["max_err"] < 1e-4, result


def test_the_isa_pin_hides_the_flags_above_avx2_only():
    flags = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_tile": True, "avx_vnni": True,
             "architecture": "x86_64"}
    seen = vllm_cpu.wrap_get_capabilities(lambda: flags)()
    assert dict(seen) == {**flags, "avx512_f": False, "avx512_bf16": False, "amx_tile": False}
    assert flags["avx512_f"]  # the original answer is not changed


@pytest.mark.parametrize("value,pinned", [("avx2", True), ("AVX2", True), ("avx512", False), (None, False)])
def test_the_isa_pin_follows_atens_capability(monkeypatch, value, pinned):
    if value is None:
        monkeypatch.delenv(vllm_cpu.ATEN_CPU_CAPABILITY_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_cpu.ATEN_CPU_CAPABILITY_ENV, value)
    assert vllm_cpu.isa_pinned() is pinned


KERNELS = textwrap.dedent("""
    import json, torch
    real = dict(torch.cpu.get_capabilities())  # before the patch table
    import stapo_cpu.activate  # applies the CPU wing's table (VERL_PLATFORM=cpu)
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from stapo_cpu.patches.vllm_cpu import loaded_vllm_kernels
    current_platform.import_kernels()
    print(json.dumps({"real": {k: real.get(k, False) for k in ("avx512_f", "avx512_bf16")},
                      "kernels": sorted(loaded_vllm_kernels()), "attention": _get_attn_isa(torch.float32, 128, 64)}))
""")


@pytest.mark.parametrize("aten", ["avx2", ""])
def test_vllm_loads_its_avx2_kernels_under_the_pin_and_the_cpus_own_otherwise(aten):
    """In a fresh process on the CPU path: under the pin vLLM loads ``_C_AVX2`` only, whatever the CPU;
    without it the library vLLM's own rule picks for this CPU's flags (read before the patch table)."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VERL_PLATFORM": "cpu", "ATEN_CPU_CAPABILITY": aten,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", KERNELS], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if aten == "avx2" or not result["real"]["avx512_f"]:
        expected = "_C_AVX2.abi3.so"
    else:
        expected = "_C.abi3.so" if result["real"]["avx512_bf16"] else "_C_AVX512.abi3.so"
    assert result["kernels"] == [expected], result
    assert result["attention"] == "vec", result


def test_the_ring_buffer_name_goes_once_readers_mapped_it():
    """The writer unlinks the name after its readers subscribed; the mapping keeps working, and the
    buffer's own cleanup does not unlink a second time."""
    shm = shared_memory.SharedMemory(create=True, size=64)
    path = f"/dev/shm/{shm.name}"
    calls = []
    buffer = SimpleNamespace(shared_memory=shm, is_creator=True)
    queue = SimpleNamespace(_is_writer=True, buffer=buffer)
    try:
        vllm_cpu.wrap_wait_until_ready(lambda self: calls.append(self))(queue)
        assert calls == [queue] and not os.path.exists(path) and buffer.is_creator is False
        shm.buf[0] = 7
        assert shm.buf[0] == 7
        reader = SimpleNamespace(_is_writer=False, buffer=SimpleNamespace(shared_memory=None, is_creator=False))
        vllm_cpu.wrap_wait_until_ready(lambda self: None)(reader)  # a reader changes nothing
    finally:
        shm.close()
        if os.path.exists(path):
            shm.unlink()


def test_the_rendezvous_file_follows_the_socket_folder(monkeypatch, tmp_path):
    wrapped = vllm_cpu.wrap_file_store_init_method(lambda: "file:///tmp/vllm_dist_x")
    monkeypatch.delenv(vllm_cpu.RPC_BASE_PATH_ENV, raising=False)
    assert wrapped() == "file:///tmp/vllm_dist_x"
    monkeypatch.setenv(vllm_cpu.RPC_BASE_PATH_ENV, str(tmp_path))
    first, second = wrapped(), wrapped()
    assert first.startswith(f"file://{tmp_path}/vllm_dist_") and first != second


def _config(rollout: str):
    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": rollout}},
                             "ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {"A": "1"}}}}})


def test_a_vllm_run_gets_a_socket_folder_removed_at_its_end(monkeypatch):
    monkeypatch.delenv(vllm_cpu.RPC_BASE_PATH_ENV, raising=False)
    config = _config("vllm")
    with pytest.raises(RuntimeError, match="the run failed"):
        with vllm_cpu.run_scratch(config) as folder:
            assert folder.is_dir() and len(str(folder)) < 40  # room for a socket name within 107 bytes
            assert os.environ[vllm_cpu.RPC_BASE_PATH_ENV] == str(folder)
            assert config.ray_kwargs.ray_init.runtime_env.env_vars[vllm_cpu.RPC_BASE_PATH_ENV] == str(folder)
            (folder / "a.sock").write_text("")
            raise RuntimeError("the run failed")
    assert not folder.exists() and vllm_cpu.RPC_BASE_PATH_ENV not in os.environ


def test_another_rollout_gets_no_socket_folder():
    config = _config("sglang")
    with vllm_cpu.run_scratch(config) as folder:
        assert folder is None
    assert vllm_cpu.RPC_BASE_PATH_ENV not in config.ray_kwargs.ray_init.runtime_env.env_vars


def test_verls_run_ppo_runs_inside_the_socket_folder_and_leaves_no_shared_memory(monkeypatch):
    """The patch cpu_vllm_run_scratch: verl's run_ppo gets the folder (in its environment and in Ray's
    runtime environment); when it returns the folder is gone, and so is the shared memory a killed
    process of the run left."""
    monkeypatch.delenv(vllm_cpu.RPC_BASE_PATH_ENV, raising=False)
    seen = {}

    def run_ppo(config, task_runner_class):
        seen["folder"] = os.environ[vllm_cpu.RPC_BASE_PATH_ENV]
        seen["runtime_env"] = config.ray_kwargs.ray_init.runtime_env.env_vars[vllm_cpu.RPC_BASE_PATH_ENV]
        seen["exists"] = os.path.isdir(seen["folder"])
        left = shared_memory.SharedMemory(create=True, size=64)
        left.close()  # never unlinked: what a killed creator leaves
        seen["left"] = f"/dev/shm/{left.name}"
        seen["runner"] = task_runner_class

    vllm_cpu.wrap_run_ppo(run_ppo)(_config("vllm"), task_runner_class="runner")
    assert seen["exists"] and seen["runtime_env"] == seen["folder"] and seen["runner"] == "runner"
    assert not os.path.exists(seen["folder"]) and not os.path.exists(seen["left"])
    assert vllm_cpu.RPC_BASE_PATH_ENV not in os.environ


def test_a_run_first_removes_the_scratch_folders_of_drivers_that_no_longer_run(monkeypatch, tmp_path):
    """What a run killed whole leaves (its driver never reached its clean-up) goes when the next run
    starts: a folder whose driver ended, or whose pid now belongs to another process; the folder of a
    live driver and one without a driver file (made by the plugin on another node) stay."""
    monkeypatch.delenv(vllm_cpu.RPC_BASE_PATH_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           timeout=60)
    folders = {name: Path(tempfile.mkdtemp(prefix=vllm_cpu.SCRATCH_PREFIX)) for name in
               ("ended", "reused", "live", "other_node")}
    (folders["ended"] / vllm_cpu.DRIVER_FILE).write_text(f"{int(ended.stdout)} 1")
    (folders["reused"] / vllm_cpu.DRIVER_FILE).write_text(f"{os.getpid()} 0")  # this pid, another start time
    (folders["live"] / vllm_cpu.DRIVER_FILE).write_text(vllm_cpu._process_identity(os.getpid()))

    with vllm_cpu.run_scratch(_config("vllm")) as folder:
        assert (folder / vllm_cpu.DRIVER_FILE).read_text() == vllm_cpu._process_identity(os.getpid())
        assert not folders["ended"].exists() and not folders["reused"].exists()
        assert folders["live"].is_dir() and folders["other_node"].is_dir()
    assert not folder.exists()


def test_a_semaphore_a_killed_run_left_goes_at_any_age_above_the_floor_and_nothing_else(cleanup):
    """Before a run starts nothing tells what a run killed whole made: every semaphore nobody holds
    and older than the floor goes; a fresh one (a process may be between creating it and its first
    use elsewhere), a live one, and an unmapped shared memory segment stay."""
    paths, procs = cleanup
    old = time.time() - 600
    names = {tag: _semaphore(tag) for tag in ("orphan-old", "orphan-new", "live-old")}
    paths += [file for _, file in names.values()]
    holder = _start(SEMAPHORE, names["live-old"][0], "hold")
    procs.append(holder)
    for tag in ("orphan-old", "orphan-new"):
        done = subprocess.run([sys.executable, "-c", SEMAPHORE, names[tag][0], "leave"], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    segment = shared_memory.SharedMemory(create=True, size=64)
    segment.close()
    paths.append(f"{SHM_DIR}/{segment.name}")
    for file in (names["orphan-old"][1], names["live-old"][1], f"{SHM_DIR}/{segment.name}"):
        os.utime(file, (old, old))

    removed = vllm_cpu.remove_orphaned_semaphores(min_age_s=60)

    assert os.path.basename(names["orphan-old"][1]) in removed and not os.path.exists(names["orphan-old"][1])
    for file in (names["orphan-new"][1], names["live-old"][1], f"{SHM_DIR}/{segment.name}"):
        assert os.path.exists(file) and os.path.basename(file) not in removed
