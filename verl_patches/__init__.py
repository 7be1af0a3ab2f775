"""Everything of this recipe that touches verl internals.

``import verl_patches`` installs the patches described in :mod:`verl_patches.install` (idempotent).
Every process gets it through ``VERL_USE_EXTERNAL_MODULES=verl_patches`` (see README). The CPU
path lives in :mod:`verl_patches.cpu` and is loaded only when selected.
"""

from .install import install

install()
