"""``python -m stapo_cpu.patches``: print the CPU wing's patch table as Markdown (docs/cpu_patches.md)."""

from .install import table

print(table(), end="")
