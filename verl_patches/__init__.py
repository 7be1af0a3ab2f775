"""Everything of this recipe that touches verl internals.

``import verl_patches`` applies the recipe's patch table (:mod:`verl_patches.install`; idempotent),
after checking that the installed verl is the release the patches were written for. Every process
gets it through ``VERL_USE_EXTERNAL_MODULES=verl_patches`` (README, "How the recipe plugs into verl").
"""

from .install import install

install()
