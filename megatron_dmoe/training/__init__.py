"""The training loop: run setup, the step, checkpoints, metrics and the run directory."""
