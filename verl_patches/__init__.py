"""Everything of this recipe that touches verl internals.

``import verl_patches`` installs the patches described in :mod:`verl_patches.install` (idempotent).
Every process gets it through ``VERL_USE_EXTERNAL_MODULES=verl_patches`` (see README).

The CPU path (:mod:`verl_patches.cpu`) is imported first because installing the patches imports
verl modules that resolve the device platform at import time; it activates only when selected
(``VERL_PLATFORM=cpu``) and is inert otherwise.
"""

from . import cpu  # noqa: F401  (registers the "cpu" platform when selected; inert otherwise)
from .install import install

install()
