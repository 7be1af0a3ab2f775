"""The CPU wing: verl's real trainer and vLLM's CPU build on a machine without a GPU (docs/cpu.md).

The recipe's core never imports it. It plugs in through ``VERL_USE_EXTERNAL_MODULES``
(:func:`stapo_cpu.trainer.cpu_env` names :mod:`stapo_cpu.activate` before ``verl_patches.activate``)
and through vLLM's plugin entry point (:mod:`stapo_cpu.patches.vllm_plugin`), both set only by the CPU
environment. Importing this package imports nothing else.
"""
