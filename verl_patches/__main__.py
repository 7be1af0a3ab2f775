"""``python -m verl_patches``: print the recipe's patch table as Markdown (docs/verl_patches.md)."""

from .install import table

print(table(), end="")
