"""The CPU wing's changes to verl 0.9.1 and vLLM: the table :data:`stapo_cpu.patches.install.PATCHES`
(``python -m stapo_cpu.patches`` prints it, docs/cpu_patches.md), applied by :mod:`stapo_cpu.activate`
only when ``VERL_PLATFORM=cpu`` selects the CPU path, and the code its entries run: the ``cpu``
platform, the thread count and FSDP2 offload (:mod:`.platform`), master ports (:mod:`.ports`), verl's
vLLM rollout on vLLM's CPU build (:mod:`.vllm_cpu`, :mod:`.vllm_plugin`), a fixed sample identity and
batch order under full determinism (:mod:`.ordering`) and a shorter replay-buffer poll
(:mod:`.replay_poll`). Importing this package, or any module in it but ``activate``, changes nothing.
"""
