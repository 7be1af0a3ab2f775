"""Importing this module applies the CPU wing's patch table in this process when ``VERL_PLATFORM=cpu``
(:func:`stapo_cpu.patches.install.install`; idempotent): every verl process of a CPU run imports it
before ``verl_patches.activate`` (``VERL_USE_EXTERNAL_MODULES``), vLLM's processes through the plugin.
"""

from .patches.install import install

install()
