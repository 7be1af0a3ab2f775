"""Importing this module applies the recipe's patch table in this process (:func:`verl_patches.install.install`:
the verl version check, ``$STAPO_SECRETS_FILE``, then every patch that applies here; idempotent).

It is the module the driver names in ``VERL_USE_EXTERNAL_MODULES`` (``import verl`` imports it in every
verl process). Nothing else in :mod:`verl_patches` changes anything when imported.
"""

from .install import install

install()
