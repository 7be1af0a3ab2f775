"""``python -m verl_patches``: print the recipe's patch table as Markdown (docs/verl_patches.md);
``python -m verl_patches check [VERL_SOURCE]``: look up what each entry relies on in a verl's source
(:func:`verl_patches.registry.check`)."""

import sys

from .install import PATCHES, table
from .registry import main

sys.exit(main(PATCHES, table, "python -m verl_patches", sys.argv[1:]))
