"""The CPU path: run verl 0.9.1's real trainer on a machine without a GPU.

Selected by the environment, never by import alone::

    VERL_PLATFORM=cpu                                   # selects the "cpu" platform below
    VERL_USE_EXTERNAL_MODULES=verl_patches,verl_patches.cpu   # makes every verl process import this
    VERL_ENGINE_DEVICE=cuda                             # engine class lookup only (FSDP engine)

plus ``actor_rollout_ref.rollout.name=hf`` in the config (``recipe.stapo.cpu.cpu_env`` and
``recipe.stapo.cpu.cpu_overrides`` build both). When ``VERL_PLATFORM`` is not ``cpu``, importing
this package changes nothing: no registration, no patch.

:func:`activate` (idempotent) applies, each a small named function documenting the verl fact it cures:

- :func:`verl_patches.cpu.platform.register`: platform ``cpu`` (device cpu, gloo, no-op device calls);
- :func:`verl_patches.cpu.platform.patch_init_process_group`: ``"cpu:gloo,cpu:gloo"`` -> ``"gloo"``;
- :func:`verl_patches.cpu.platform.patch_fsdp2_offload_pinning`: no pinned memory without CUDA;
- :func:`verl_patches.cpu.hf_rollout.register`: the ``hf`` rollout (server replica + trainer adapter);
- :func:`verl_patches.cpu.platform.pin_threads`: one fixed torch/OpenMP thread count in every process
  (``STAPO_CPU_THREADS``), so that results do not depend on the machine's load;
- :func:`verl_patches.cpu.ordering.apply`: under ``rollout.full_determinism``, per-sample request ids
  and a fixed batch order in verl's TransferQueue trainer (docs/reproducibility.md).
"""

from .activation import PLATFORM_ENV, activate, cpu_selected, is_active

__all__ = ["PLATFORM_ENV", "activate", "cpu_selected", "is_active"]

if cpu_selected():  # selected by the environment, never by import alone
    activate()
