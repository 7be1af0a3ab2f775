"""Everything of this recipe that touches verl internals.

Importing this package, or any module in it, changes nothing: the recipe's patch table
(:mod:`verl_patches.install`) is applied by importing :mod:`verl_patches.activate`, the module every
verl process is told to import (``VERL_USE_EXTERNAL_MODULES=verl_patches.activate``; README, "How
the recipe plugs into verl").
"""
