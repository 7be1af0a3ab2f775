"""``python -m stapo_cpu.patches``: print the CPU wing's patch table as Markdown (docs/cpu_patches.md);
``python -m stapo_cpu.patches check [VERL_SOURCE]``: look up what each entry relies on in a verl's source
and the installed vLLM and torch (:func:`verl_patches.registry.check`)."""

import sys

from verl_patches.registry import main

from .install import PATCHES, table

sys.exit(main(PATCHES, table, "python -m stapo_cpu.patches", sys.argv[1:]))
