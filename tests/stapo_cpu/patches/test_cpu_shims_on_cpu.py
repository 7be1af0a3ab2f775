"""The CPU shims (stapo_cpu.patches): inert unless selected; platform and patches; the run helpers.

Process-global state (verl's platform singleton, registries, torch patches) is checked in fresh
interpreters (subprocess), so these tests neither depend on nor disturb the rest of the suite.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
from tests.helpers.paths import REPO


PROBE = textwrap.dedent(
    """
    import json, sys
    import torch.distributed as dist
    before = dist.init_process_group
    {imports}
    from verl.plugin.platform import PlatformRegistry, get_platform
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.workers.engine.fsdp import transformer_impl
    platform = get_platform()
    def cpu_active():
        if "stapo_cpu.patches.install" not in sys.modules:
            return False
        from stapo_cpu.patches.install import PATCHES
        from verl_patches.registry import applies_here, is_applied
        return all(is_applied(p) for p in PATCHES if applies_here(p))
    print(json.dumps({{
        "platforms": list(PlatformRegistry.registered_names()),
        "platform_class": type(platform).__name__,
        "device": platform.device_name,
        "rollouts": sorted(k[0] for k in _ROLLOUT_REGISTRY),
        "replicas": sorted(RolloutReplicaRegistry._registry),
        "init_pg_patched": dist.init_process_group is not before,
        "offload_patched": getattr(transformer_impl.CPUOffloadPolicy, "__stapo_patch__", None) is not None,
        "cpu_loaded": "stapo_cpu.patches" in sys.modules,
        "cpu_active": cpu_active(),
    }}))
    """
)


def _probe(imports: str, **env_overrides: str) -> dict:
    """Run PROBE in a fresh interpreter with the CPU selection variables removed, then set."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES", "VERL_ENGINE_DEVICE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(env_overrides)
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def baseline() -> dict:
    return _probe("")


@pytest.mark.slow
def test_importing_the_activations_without_selection_changes_nothing(baseline):
    probed = _probe("import stapo_cpu.activate, verl_patches.activate")
    assert probed["cpu_loaded"] and not probed["cpu_active"]
    for key in ("platforms", "platform_class", "device", "rollouts", "replicas"):
        assert probed[key] == baseline[key], key
    assert "cpu" not in probed["platforms"]
    assert not probed["init_pg_patched"] and not probed["offload_patched"]


@pytest.mark.slow
def test_selecting_cpu_activates_every_shim():
    probed = _probe("import stapo_cpu.activate, verl_patches.activate", VERL_PLATFORM="cpu")
    assert probed["cpu_active"]
    assert "cpu" in probed["platforms"] and probed["platform_class"] == "PlatformCPU" and probed["device"] == "cpu"
    assert "vllm" in probed["replicas"]  # verl's own; the CPU path adds no rollout of its own
    assert probed["init_pg_patched"] and probed["offload_patched"]


# ------------------------------------------------------------------------------------------------
# in-process units (no patch applied)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given,expected", [
    ("cpu:gloo,cpu:gloo", "gloo"),
    ("cpu:gloo, cpu:gloo", "gloo"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    ("gloo", "gloo"),
    ("cpu:gloo", "cpu:gloo"),
    (None, None),
])
def test_normalise_backend(given, expected):
    from stapo_cpu.patches.platform import normalise_backend

    assert normalise_backend(given) == expected


def test_cpu_device_module_calls():
    from stapo_cpu.patches.platform import CPU_DEVICE_MODULE as dev

    dev.empty_cache()
    dev.synchronize()
    free, total = dev.mem_get_info()
    assert 0 < free <= total
    assert dev.memory_allocated() == 0 and dev.max_memory_reserved() == 0
    assert dev.get_device_name() == "CPU" and dev.is_available() and dev.current_device() == "cpu"
    state = dev.get_rng_state()
    first = torch.rand(3)
    dev.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))
    with pytest.raises(AttributeError, match="no 'definitely_not_a_call'"):
        dev.definitely_not_a_call


def test_platform_class_contract():
    from stapo_cpu.patches.platform import platform_class

    platform = platform_class()()
    assert platform.device_name == "cpu" and platform.communication_backend_name() == "gloo"
    assert platform.is_available() and not platform.is_platform_available(use_smi_check=True)
    assert platform.current_device() == "cpu" and platform.device_count() == 1
    assert torch.zeros(2).to(platform.current_device()).device.type == "cpu"
    with platform.nvtx_range("x"):
        pass
    assert platform.get_device_capability() == (None, None) and not platform.is_ipc_supported()


@pytest.mark.slow
def test_patched_init_process_group_accepts_verl_backend(tmp_path):
    """A real single-process gloo group from verl's backend string (fresh interpreter)."""
    code = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from stapo_cpu.patches.install import PATCHES
        from verl_patches.registry import apply, original_of
        (patch,) = [p for p in PATCHES if p.target == "torch.distributed:init_process_group"]
        assert apply(patch) and not apply(patch)   # once
        assert original_of(dist.init_process_group).__module__ == "torch.distributed.distributed_c10d"
        dist.init_process_group(backend="cpu:gloo,cpu:gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
        t = torch.ones(3); dist.all_reduce(t)
        assert dist.get_backend() == "gloo" and t.tolist() == [1.0, 1.0, 1.0]
        dist.destroy_process_group(); print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# ------------------------------------------------------------------------------------------------
# the run configuration helpers (stapo_cpu.trainer)
# ------------------------------------------------------------------------------------------------


def test_cpu_env_selects_the_cpu_path(tmp_path):
    from stapo_cpu.trainer import cpu_env

    env = cpu_env(tmp_path / "run", base={"VERL_USE_EXTERNAL_MODULES": "other.mod", "PATH": "/bin"})
    assert env["VERL_PLATFORM"] == "cpu" and env["VERL_ENGINE_DEVICE"] == "cuda"
    # the wing's table before the core's, whatever order the base listed them in; other modules after
    assert env["VERL_USE_EXTERNAL_MODULES"].split(",") == ["stapo_cpu.activate", "verl_patches.activate", "other.mod"]
    listed = cpu_env(base={"VERL_USE_EXTERNAL_MODULES": "verl_patches.activate,other.mod,stapo_cpu.activate"})
    assert listed["VERL_USE_EXTERNAL_MODULES"] == "stapo_cpu.activate,verl_patches.activate,other.mod"
    assert env["VERL_FILE_LOGGER_PATH"] == str((tmp_path / "run").resolve() / "metrics.jsonl")
    assert (tmp_path / "run").is_dir() and env["PATH"] == "/bin"


def test_cpu_env_and_overrides_fix_threads_and_determinism(tmp_path):
    from stapo_cpu.trainer import cpu_env, cpu_overrides

    env = cpu_env(base={"OMP_NUM_THREADS": "8"}, threads=3)
    assert {k: env[k] for k in ("STAPO_CPU_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")} == dict.fromkeys(
        ("STAPO_CPU_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"), "3")
    assert cpu_env(base={})["STAPO_CPU_THREADS"] == "1"
    with pytest.raises(ValueError, match="threads"):
        cpu_env(base={}, threads=0)
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "manifest.json").write_text("{}")
    from recipe.stapo.driver import compose

    # the CPU rollout's settings (cpu_overrides) as Hydra composes them
    config = compose(["method=stapo", *cpu_overrides(tmp_path / "assets", tmp_path / "run")])
    arr = config.actor_rollout_ref
    assert arr.rollout.name == "vllm"
    assert arr.rollout.full_determinism and arr.actor.fsdp_config.full_determinism and arr.ref.fsdp_config.full_determinism
    # what vLLM's CPU build needs (docs/cpu.md)
    assert (arr.rollout.dtype, arr.rollout.enforce_eager, arr.rollout.enable_sleep_mode,
            arr.rollout.free_cache_engine, arr.rollout.load_format) == ("float32", True, False, False, "dummy")


ISA_KEYS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def test_cpu_env_and_ray_workers_hold_the_math_libraries_to_avx2(tmp_path):
    from stapo_cpu.trainer import cpu_env, cpu_overrides
    from stapo_cpu.isa import isa_env

    pinned = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2,STRICT",
              "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert isa_env(machine="x86_64") == pinned and isa_env(machine="AMD64") == pinned
    assert isa_env(machine="aarch64") == {} and isa_env("native", machine="x86_64") == {}
    with pytest.raises(ValueError, match="isa"):
        isa_env("avx512")
    # an inherited setting (here: a user's AVX-512) is overridden; "native" leaves the environment as it is
    inherited = {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    env = cpu_env(base=inherited, isa="avx2")
    assert {k: env.get(k) for k in ISA_KEYS} == {**dict.fromkeys(ISA_KEYS), **isa_env()}
    assert {k: cpu_env(base=inherited, isa="native").get(k) for k in inherited} == inherited
    # Ray workers get the same settings through the job's runtime environment
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "manifest.json").write_text("{}")
    overrides = cpu_overrides(tmp_path / "assets", tmp_path / "run")
    for key, value in isa_env().items():
        assert f"++ray_kwargs.ray_init.runtime_env.env_vars.{key}='{value}'" in overrides
    assert not any(k in o for o in cpu_overrides(tmp_path / "assets", tmp_path / "run", isa="native") for k in ISA_KEYS)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the pin is an x86 one")
def test_a_process_started_with_cpu_env_runs_torch_at_avx2():
    """The variables take effect where they matter: a fresh process reports ATen's capability as AVX2
    (on an AVX-512 machine it would otherwise report AVX512), and MKL/oneDNN read theirs."""
    from stapo_cpu.trainer import cpu_env

    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", code], env=cpu_env(base=dict(os.environ, ATEN_CPU_CAPABILITY="avx512")),
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "AVX2", out


def test_pin_threads_sets_torch_threads_from_the_environment():
    from stapo_cpu.patches.platform import THREADS_ENV, pin_threads

    before = torch.get_num_threads()
    try:
        assert pin_threads({}) is None and torch.get_num_threads() == before
        wanted = 1 if before != 1 else 2
        assert pin_threads({THREADS_ENV: str(wanted)}) == wanted and torch.get_num_threads() == wanted
        for bad in ("0", "-2", "two"):
            with pytest.raises(ValueError, match=THREADS_ENV):
                pin_threads({THREADS_ENV: bad})
    finally:
        torch.set_num_threads(before)


def test_cpu_overrides_validation(tmp_path):
    from stapo_cpu.trainer import cpu_overrides, trainer_command

    with pytest.raises(ValueError, match="no tiny assets"):
        cpu_overrides(tmp_path / "missing", tmp_path / "run")
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="mini_batch_prompts"):
        cpu_overrides(tmp_path / "assets", tmp_path / "run", prompts=3, mini_batch_prompts=2)
    overrides = cpu_overrides(tmp_path / "assets", tmp_path / "run", use_v1=False, resume=True, extra=["x=1"])
    assert "actor_rollout_ref.rollout.name=vllm" in overrides and "trainer.use_v1=false" in overrides
    assert "trainer.resume_mode=auto" in overrides and overrides[-1] == "x=1"
    with pytest.raises(ValueError, match="unknown method"):
        trainer_command("ppo", overrides)


def test_read_metrics_tolerates_only_a_truncated_last_line(tmp_path):
    from recipe.stapo.metrics import read_metrics

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "data": {"a": 1.0}}\n{"step": 2, "data": {"a": 2.0}}\n{"step": 3, "da')
    assert read_metrics(path) == {1: {"a": 1.0}, 2: {"a": 2.0}}
    path.write_text('{"step": 1, "data": {"a": 1.0}}\nnot json\n{"step": 2, "data": {"a": 2.0}}\n')
    with pytest.raises(ValueError, match=r"m.jsonl: line 2"):
        read_metrics(path)


def test_v1_ordering_patches_sort_batches_and_count_uids_only_under_full_determinism(monkeypatch):
    from stapo_cpu.patches import ordering

    keys = ["b_0_0", "a_10_0", "a_2_1", "a_2_0", "odd"]
    assert sorted(keys, key=ordering.trajectory_sort_key) == ["a_2_0", "a_2_1", "a_10_0", "b_0_0", "odd"]
    counter = ordering.CountingUUID()
    monkeypatch.setenv(ordering.FULL_DETERMINISM_ENV, "1")
    assert [str(counter.uuid4()) for _ in range(2)] == ["00000000-0000-0000-0000-000000000001",
                                                        "00000000-0000-0000-0000-000000000002"]
    monkeypatch.setenv(ordering.FULL_DETERMINISM_ENV, "0")
    assert len({counter.uuid4() for _ in range(3)}) == 3 and counter.uuid4().version == 4
    assert counter.UUID is ordering._uuid.UUID  # anything else is the uuid module's


def test_replay_poll_patch_lowers_only_the_interval():
    import inspect

    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from stapo_cpu.patches.replay_poll import CPU_POLL_INTERVAL_S, wrap_replay_buffer_init

    # what the patch relies on: verl's constructor takes poll_interval (2 s by default) and the
    # wait between checks sleeps it
    assert inspect.signature(ReplayBuffer.__init__).parameters["poll_interval"].default == 2.0
    assert "time.sleep(self.poll_interval)" in inspect.getsource(ReplayBuffer._wait_for_next_poll)

    class Buffer:
        def __init__(self, mode, poll_interval=2.0, other=None):
            self.mode, self.poll_interval, self.other = mode, poll_interval, other

    Buffer.__init__ = wrap_replay_buffer_init(Buffer.__init__)
    assert CPU_POLL_INTERVAL_S < 2.0
    default, slow, fast = Buffer("sync", other=3), Buffer("sync", poll_interval=5), Buffer("sync", 0.01)
    assert (default.mode, default.other, default.poll_interval) == ("sync", 3, CPU_POLL_INTERVAL_S)
    assert slow.poll_interval == CPU_POLL_INTERVAL_S and fast.poll_interval == 0.01
