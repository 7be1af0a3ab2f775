"""``run_scripts/slurm/stapo.sbatch`` in its dry run: the Ray head on the allocation's first node, a
worker on each other one, token authentication for every node and the jobs client, and the run
submitted as a detached job over all nodes (``SMOKE=1``: 2 steps with short lengths). The same
mechanism on a real two-node Ray cluster: tests/e2e/test_two_node_on_cpu.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

from recipe.stapo.driver import compose
from tests.helpers.paths import REPO
from tests.helpers.verl_validation import validate

SBATCH = REPO / "run_scripts" / "slurm" / "stapo.sbatch"
NODES = ["gpu01", "gpu02", "gpu03"]


def _dry_run(tmp_path, *args, nodes=NODES, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"  # Slurm's node-list expansion, as `scontrol show hostnames` prints it
    scontrol.write_text("#!/usr/bin/env bash\n[ \"$1 $2\" = \"show hostnames\" ] && printf '%s\\n' " + " ".join(nodes) + "\n")
    scontrol.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("STAPO_", "RAY_", "SLURM_", "LAUNCH", "NNODES"))}
    base.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_NODELIST=f"gpu[01-0{len(nodes)}]",
                SLURM_GPUS_ON_NODE="8", SLURM_CPUS_PER_TASK="32", SLURM_SUBMIT_DIR=str(REPO), STAPO_DRY_RUN="1",
                PYTHON=sys.executable, HOME=str(tmp_path), **env)
    proc = subprocess.run(["bash", str(SBATCH), *args], cwd=tmp_path, env=base, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line.rstrip(" &")) for line in proc.stdout.strip().splitlines()], proc.stderr


def test_a_head_then_one_worker_per_other_node(tmp_path):
    lines, _ = _dry_run(tmp_path)
    starts = [line for line in lines if line[0] == "srun"]
    assert [line[line.index("-w") + 1] for line in starts] == NODES
    head, workers = starts[0], starts[1:]
    assert head[head.index("-w") + 2:][:3] == ["ray", "start", "--head"]
    assert "--port=6379" in head and "--num-gpus=8" in head and "--num-cpus=32" in head and "--block" in head
    head_ip = next(a for a in head if a.startswith("--node-ip-address=")).split("=", 1)[1]
    assert f"--dashboard-host={head_ip}" in head  # not 0.0.0.0
    for worker in workers:
        assert f"--address={head_ip}:6379" in worker and "--block" in worker and "--head" not in worker


def test_the_run_is_submitted_over_every_node_of_the_allocation(tmp_path):
    lines, stderr = _dry_run(tmp_path, "actor_rollout_ref.actor.policy_loss.q=0.5")
    (submit,) = [line for line in lines if line[:3] == ["ray", "job", "submit"]]
    assert "--no-wait" in submit and submit[submit.index("--address") + 1].endswith(":8265")
    entry = submit[submit.index("--") + 1:]
    cfg = compose(entry[3:])
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (3, 8)
    assert cfg.recipe.model == "qwen3_8b" and cfg.actor_rollout_ref.actor.policy_loss.q == 0.5
    runtime_env, _ = json.JSONDecoder().raw_decode(stderr.split("secret values masked:\n", 1)[1])
    assert not [k for k in runtime_env["env_vars"] if "RAY_AUTH" in k]  # the token never travels with the job


def test_smoke_mode_is_two_short_steps_with_a_checkpoint(tmp_path):
    lines, _ = _dry_run(tmp_path, nodes=NODES[:2], SMOKE="1")
    (submit,) = [line for line in lines if line[:3] == ["ray", "job", "submit"]]
    cfg = compose(submit[submit.index("--") + 4:])
    validate(cfg)
    assert cfg.recipe.model == "qwen3_1_7b" and cfg.trainer.experiment_name == "smoke_multinode"
    assert cfg.trainer.total_training_steps == cfg.trainer.save_freq == 2 and cfg.data.max_response_length == 1024
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 8) and "wandb" not in cfg.trainer.logger


def test_outside_the_checkout_it_says_where_to_run_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAPO_", "SLURM_"))}
    proc = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, env={**env, "SLURM_SUBMIT_DIR": str(tmp_path)},
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "not the project's checkout" in proc.stderr


def test_off_a_slurm_host_it_says_it_needs_scontrol(tmp_path):
    """It was `nodes[0]: unbound variable`: the node list's expansion failed unseen."""
    bare = tmp_path / "bin"  # a PATH without Slurm's tools
    bare.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAPO_", "SLURM_"))}
    env.update(PATH=str(bare), SLURM_SUBMIT_DIR=str(REPO), STAPO_DRY_RUN="1", HOME=str(tmp_path))
    run = lambda **extra: subprocess.run(["/bin/bash", str(SBATCH)], cwd=tmp_path, env={**env, **extra},  # noqa: E731
                                         capture_output=True, text=True)
    proc = run(SLURM_JOB_NODELIST="gpu[01-02]")
    assert proc.returncode == 2 and proc.stderr.startswith("scontrol not found: stapo.sbatch runs on a Slurm host")
    assert "unbound variable" not in proc.stderr and proc.stdout == ""
    unset = run()
    assert unset.returncode == 2 and unset.stderr.startswith("SLURM_JOB_NODELIST is not set: run it with sbatch")
