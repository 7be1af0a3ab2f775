"""GPU memory of a training step: :mod:`.model` estimates it pass by pass from the model's shape and
the run's settings (the preflight's memory check), :mod:`.calibration` sets a GPU run's measured
peaks beside the estimate (docs/memory.md)."""
