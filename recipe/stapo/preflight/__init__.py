"""Preflight: what would fail on the cluster (some of it hours in) or run silently wrong, refused in
the driver before Ray starts, every refusal naming the key or path and the fix (docs/preflight.md).

:func:`check` runs on a config whose interpolations are resolved and whose local paths are absolute
(:func:`recipe.stapo.config_utils.prepare` calls it, so ``--check`` / ``STAPO_DRY_RUN=check`` and a
real launch run the same checks, the latter also in a submitted job's own driver on the head node):

- numbers: positive integers for nodes, GPUs, lengths, batch sizes and budgets; ``rollout.n >= 2``
  for group-normalised advantages; batch, mini-batch, micro-batch and world-size divisibility as
  verl checks them without dynamic batching; token budgets that hold the longest sequence;
- names: the policy loss is registered, the token-selection settings are valid, the advantage
  estimator exists, the reward function resolves in its module;
- identity: a method's run selects the method's tokens (``method=stapo``: S2T), unless the
  experiment name says what it runs instead;
- paths: data files are parquet with the columns the run reads; the model folder has a config, a
  tokenizer and weights; the checkpoint folder (and the token dump's) can be created and written
  (a probe file, removed with any folder made for it); the token dump's settings;
- context: prompt + response within the context vLLM serves (the model's ``config.json``);
- GPU memory (:data:`~recipe.stapo.preflight.run.MEMORY_CHECK`, imported when it runs): the model's
  ``config.json`` read whole and the estimate per pass against ``recipe.gpu_mem_gb`` (``GPU_MEM_GB``);
  a refusal names changes that make every pass fit, each run through the whole preflight first.

With ``LAUNCH=submit`` the launching machine may not see the cluster's storage: a path it cannot see
is reported as a note, not refused (the job's driver checks it on the head node).

Importing this module imports no verl.
"""
from .paths import probe_writable
from .problem import PreflightError, Problem, Report
from .run import check, problems_of, summary
from .values import check_environment

__all__ = ["PreflightError", "Problem", "Report", "check", "check_environment", "probe_writable", "problems_of",
           "summary"]
