"""The training-time spurious-token dump, actor side.

* :mod:`.settings`: switched on and configured by ``recipe.token_dump.*`` (environment variables
  in every Ray worker);
* :mod:`.scoring`: per sampled response, p, H, the closed-form gradient norm and the top-5
  alternatives, turned into records;
* :mod:`.hook`: called by the actor once per mini-batch (first of each step), writes the step file.

The record format, writer and reader are :mod:`stapo_core.token_records` (shared with the
inspector and the plots).
"""
