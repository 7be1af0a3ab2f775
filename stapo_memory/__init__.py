"""The GPU memory planner, a wing the recipe's core never imports (docs/memory.md): the memory model
(:mod:`.shape`, :mod:`.terms`, :mod:`.model`, :mod:`.advice`), the preflight's memory check (:mod:`.preflight`,
named by the preflight as data), the verdict table, and a calibration run's probes and reading."""
