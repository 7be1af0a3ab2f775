"""The suite's shared trainer runs: verl's real trainer on CPU, each run made at most once per session.

A trainer run costs ~1.5 minutes on 2 cores, most of it starting Ray and importing torch and verl
in each of its processes, so the end-to-end tests share runs: each test module asks for a run by
name (:meth:`SharedRuns.get`), the first asker pays for it, later ones read what it left. A run is
configured to serve every module that reads it (STAPO's run also writes a token dump and a
checkpoint). The table, and which modules read each run:

============================  =========================================================================
``stapo_v1``                  STAPO, TransferQueue trainer, ``tau_p=0.5`` (the tiny model has
                              candidates), checkpoint at step 2, token dump of the first mini-batch:
                              tests/e2e/test_trainer_e2e_on_cpu.py, test_reproducible_e2e_on_cpu.py
                              (its first run), tests/verl_patches/token_dump/test_token_dump_on_cpu.py,
                              tests/e2e/test_vllm_rollout_e2e_on_cpu.py,
                              tests/stapo_cpu/test_quickstart_evaluate_on_cpu.py (its checkpoint)
``grpo_v1``                   GRPO on the TransferQueue trainer: test_trainer_e2e_on_cpu.py
``entropy20_v1``              20-Entropy on the TransferQueue trainer, two data-parallel ranks with
                              ``ranks_per_pool=1``, the ungraded-answer reward and a rollout dump:
                              test_trainer_e2e_on_cpu.py, test_ungraded_e2e_on_cpu.py
``justrl_legacy``             JustRL on the legacy trainer, the ungraded-answer reward and a rollout
                              dump: test_trainer_e2e_on_cpu.py, test_ungraded_e2e_on_cpu.py
``stapo_gspo_legacy``         STAPO on verl's GSPO loss (``sequence_ratio=all_tokens``), legacy
                              trainer: test_trainer_e2e_on_cpu.py, test_token_selection_e2e_on_cpu.py
============================  =========================================================================

Every method runs on verl's default trainer or the legacy one and STAPO on both; the method's code
is in the loss, which is the same on both trainers. Runs with a recorder of their own
(test_current_stats_e2e_on_cpu.py), through a script (tests/run_scripts/test_gpu_smoke_on_cpu.py) or
on a cluster of their own (test_two_node_on_cpu.py) are made by those modules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from stapo_cpu.trainer import CPURun
from tests.helpers import ungraded_reward
from tests.helpers.vllm_watch import watched_run
from verl_patches.token_dump import settings as token_dump_settings

RUN_TIMEOUT_S = 600
#: the tests that read these runs (test id prefixes): one unit of work for pytest-xdist, so that each
#: run is made once in a session (tests/conftest.py schedules them on one worker, and refuses a test
#: that asks for the ``shared_runs`` fixture without being listed here)
READERS = (
    "tests/e2e/test_trainer_e2e_on_cpu.py::",
    "tests/e2e/test_reproducible_e2e_on_cpu.py::",
    "tests/e2e/test_token_selection_e2e_on_cpu.py::",
    "tests/verl_patches/token_dump/test_token_dump_on_cpu.py::test_real_run",
    "tests/e2e/test_ungraded_e2e_on_cpu.py::",
    "tests/e2e/test_vllm_rollout_e2e_on_cpu.py::",
    "tests/stapo_cpu/test_quickstart_evaluate_on_cpu.py::",
)


def reads_shared_runs(nodeid: str) -> bool:
    """The test ``nodeid`` is one of :data:`READERS`."""
    return nodeid.startswith(READERS)
PL = "actor_rollout_ref.actor.policy_loss"
#: STAPO's run: a probability threshold at which the tiny model has spurious-token candidates
STAPO_TAU_P = 0.5
#: responses the token dump writes per step (every response of the first mini-batch: 2 prompts x 4)
DUMP_RESPONSES = 8
#: tokens of context the dump keeps around each token
DUMP_CONTEXT = 8
#: the ranks of the two-rank run (``entropy20_v1``)
RANKS = 2
#: responses per step of every shared run (cpu_overrides' defaults: 4 prompts x 4 samples)
RESPONSES_PER_STEP = 16
#: sequences per mini-batch (2 prompts x 4 samples)
MINI_BATCH_SEQUENCES = 8


@dataclass(frozen=True)
class RunSpec:
    """One shared run: ``run_cpu_trainer(method, ..., **kwargs, extra=extra)``; ``dump``: the run's
    folder also holds a token dump; ``ungraded``: the training reward leaves every other response
    ungraded (tests/helpers/ungraded_reward.py) and each step's responses are dumped to
    ``<run>/rollouts`` (``trainer.rollout_data_dir``)."""

    method: str
    kwargs: dict = field(default_factory=dict)
    extra: tuple[str, ...] = ()
    dump: bool = False
    ungraded: bool = False

    def overrides(self, run_dir: Path) -> list[str]:
        """The Hydra overrides beyond :func:`stapo_cpu.trainer.cpu_overrides`'s, for a run in ``run_dir``."""
        dump = [f"recipe.token_dump.dir={run_dir}", f"recipe.token_dump.responses={DUMP_RESPONSES}",
                f"recipe.token_dump.context={DUMP_CONTEXT}",
                f"++ray_kwargs.ray_init.runtime_env.env_vars.{token_dump_settings.IDS_ENV}='1'"] if self.dump else []
        ungraded = [f"reward.custom_reward_function.path={Path(ungraded_reward.__file__).resolve()}",
                    "reward.custom_reward_function.name=compute_score",
                    f"trainer.rollout_data_dir={run_dir / 'rollouts'}"] if self.ungraded else []
        return [*dump, *ungraded, *self.extra]


RUNS: dict[str, RunSpec] = {
    "stapo_v1": RunSpec("stapo", {"use_v1": True, "save_freq": 2}, (f"{PL}.tau_p={STAPO_TAU_P}",), dump=True),
    "grpo_v1": RunSpec("grpo", {"use_v1": True}),
    "entropy20_v1": RunSpec("entropy20", {"use_v1": True}, (
        f"{PL}.ranks_per_pool=1", f"trainer.n_gpus_per_node={RANKS}", f"ray_kwargs.ray_init.num_gpus={RANKS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MINI_BATCH_SEQUENCES // RANKS}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={RESPONSES_PER_STEP // RANKS}"), ungraded=True),
    "justrl_legacy": RunSpec("justrl", {"use_v1": False}, ungraded=True),
    "stapo_gspo_legacy": RunSpec("stapo", {"use_v1": False}, (f"{PL}.loss_mode=gspo", f"{PL}.sequence_ratio=all_tokens")),
}


def run(name: str, assets: Path, run_dir: Path) -> CPURun:
    """Make the run ``name`` of :data:`RUNS` in ``run_dir`` (also used to repeat one elsewhere),
    watched for what vLLM loads and leaves (:func:`tests.helpers.vllm_watch.watched_run`)."""
    spec = RUNS[name]
    return watched_run(spec.method, assets, run_dir, steps=2, timeout=RUN_TIMEOUT_S,
                       extra=spec.overrides(Path(run_dir).resolve()), **spec.kwargs)


class SharedRuns:
    """The runs of :data:`RUNS`, each made on first request under ``root/<name>``; wall times go to
    ``root/walls.json`` and the test output."""

    def __init__(self, assets: Path, root: Path):
        self.assets, self.root = Path(assets), Path(root)
        self._done: dict[str, CPURun] = {}

    def get(self, name: str) -> CPURun:
        if name not in RUNS:
            raise KeyError(f"no shared run {name!r}; the table has {sorted(RUNS)}")
        if name not in self._done:
            result = run(name, self.assets, self.root / name)
            self._done[name] = result
            print(f"[shared run] {result}")
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "walls.json").write_text(json.dumps({k: r.wall_s for k, r in self._done.items()}, indent=2))
        return self._done[name]
