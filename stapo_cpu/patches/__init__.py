"""The CPU wing's changes to verl 0.9.1 and vLLM: the table :data:`stapo_cpu.patches.install.PATCHES`
(``python -m stapo_cpu.patches`` prints it, with how it is applied: docs/cpu_patches.md) and the code its
entries run. Importing this package, or any module in it but ``activate``, changes nothing.
"""
