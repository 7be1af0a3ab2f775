"""Evaluation of STAPO checkpoints: generation, grading, summaries and the paper's Table 2."""
