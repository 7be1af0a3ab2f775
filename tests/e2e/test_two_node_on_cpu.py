"""A real two-node Ray cluster on this machine, run the way docs/cluster.md tells an operator to.

A head and a second node (``ray start --block``, each with its own temp dir and ports, token
authentication on: ``RAY_AUTH_MODE=token`` and the cluster's token in a private file named by
``RAY_AUTH_TOKEN_PATH``, exported before ``ray start`` as the runbook says) get one logical GPU each.
From a launch directory of its own, the test then runs ``run_scripts/common.sh`` with
``LAUNCH=submit`` and the jobs address in ``RAY_API_SERVER_ADDRESS``: STAPO on the tiny CPU assets
with verl's vLLM rollout (a vLLM server on each node, vLLM's CPU build), ``trainer.nnodes=2``, 2 steps, a checkpoint each step, at most 2 kept, relative ``CKPT_DIR`` and
token-dump folder. Its submitting shell has the token file but not ``RAY_AUTH_MODE`` (common.sh
turns it on). While the job runs the same command is launched again and must be refused. After
the job, the same command with ``trainer.total_training_steps=3`` relaunches the run.

Checks (each test reads what the two jobs left): token authentication is on; the training workers
and the vLLM servers ran on both nodes; metrics, checkpoints and token dump are where the docs say
(under the launch directory and ``CKPT_DIR/<project>/<experiment>``, nothing in Ray's copy of the
project); the second submission was refused; the relaunch resumed from step 2, the metrics file
holds steps 1-3 once each, retention kept the 2 newest checkpoints (removing one saved by the
first job) and left the Hugging Face copy beside it; both jobs logged to wandb (offline) and the
relaunch continued the first job's wandb run. Every process the cluster started (found by a
marker variable in its environment) is ended by its process id, also when a check fails; no
``ray stop`` (it would stop other clusters of this machine). Cost: ~4-6 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from recipe.stapo.driver import wandb_run_id
from stapo_cpu.trainer import cpu_env, cpu_overrides
from tests.e2e.test_trainer_e2e_on_cpu import MAX_PROB_DIFF
from tests.helpers.paths import REPO
from tests.helpers.wandb_offline import offline_runs

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

COMMON = REPO / "run_scripts" / "common.sh"
RAY = str(Path(sys.executable).parent / "ray")
PROJECT, EXPERIMENT = "two_node", "stapo_cpu"
JOB_TIMEOUT_S = 600
#: keys common.sh sets from its environment (the CPU overrides must not replace them)
SET_BY_COMMON = ("trainer.default_local_dir", "trainer.project_name", "trainer.experiment_name", "trainer.logger",
                 "trainer.nnodes", "trainer.n_gpus_per_node")
MARKER = "STAPO_TWO_NODE_CLUSTER"


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_range(width: int, avoid: set[int]) -> int:
    """The first port of ``width`` consecutive ports that can all be bound now."""
    for _ in range(200):
        base = 20000 + secrets.randbelow(40000 - width)
        ports = range(base, base + width)
        if avoid.intersection(ports):
            continue
        try:
            socks = []
            for port in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range for Ray's workers")


def _marked_pids(marker: str) -> list[int]:
    """Processes of this user whose environment carries ``MARKER=marker``: every process the cluster started,
    including those that left its process tree (the job driver runs in a session of its own)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


class Cluster:
    """Two Ray nodes on this machine, each started by ``ray start --block`` in a process of its own."""

    def __init__(self, root: Path):
        self.root = root
        self.wandb_dir = root / "wandb_runs"  # the jobs' wandb logger, offline
        self.wandb_dir.mkdir()
        self.marker = secrets.token_hex(8)
        self.token = root / "auth_token"
        self.token.write_text(secrets.token_hex(32))
        self.token.chmod(0o600)
        gcs, dashboard, client, agent_head, agent_worker = _free_ports(5)
        self.gcs, self.dashboard_url = f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"
        workers = _free_range(200, {gcs, dashboard, client, agent_head, agent_worker})
        common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=8", "--num-gpus=1",
                  "--object-store-memory=150000000", "--disable-usage-stats"]
        self.commands = {
            "head": [RAY, "start", "--head", f"--port={gcs}", f"--dashboard-port={dashboard}",
                     "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}",
                     f"--temp-dir={root / 'head'}", f"--dashboard-agent-listen-port={agent_head}",
                     f"--min-worker-port={workers}", f"--max-worker-port={workers + 99}", *common],
            "worker": [RAY, "start", f"--address={self.gcs}", f"--temp-dir={root / 'worker'}",
                       f"--dashboard-agent-listen-port={agent_worker}",
                       f"--min-worker-port={workers + 100}", f"--max-worker-port={workers + 199}", *common],
        }
        self.procs: dict[str, subprocess.Popen] = {}

    def node_env(self) -> dict[str, str]:
        """What the runbook exports before ``ray start`` on every node: token authentication, and here
        the CPU path's settings (the project itself reaches the nodes with the job, not via PYTHONPATH)."""
        env = cpu_env(base=_clean_env())
        env.pop("PYTHONPATH", None)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token), RAY_USAGE_STATS_ENABLED="0",
                   **{MARKER: self.marker})
        return env

    def client_env(self, **extra: str) -> dict[str, str]:
        """The submitting shell: the token file, the jobs address; no RAY_AUTH_MODE, no RAY_ADDRESS."""
        env = _clean_env()
        env.update(RAY_AUTH_TOKEN_PATH=str(self.token), RAY_API_SERVER_ADDRESS=self.dashboard_url, **extra)
        return env

    def start(self) -> None:
        for name in ("head", "worker"):
            log = open(self.root / f"{name}.log", "w")
            self.procs[name] = subprocess.Popen(self.commands[name], env=self.node_env(), stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.time() + 180
            while len(self.alive_nodes()) < (1 if name == "head" else 2):
                if self.procs[name].poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"ray {name} did not come up:\n{(self.root / f'{name}.log').read_text()[-3000:]}")
                time.sleep(2)

    def query(self, code: str, timeout: float = 120):
        """Run ``code`` (it prints one JSON value) in a fresh interpreter with the client's credentials."""
        env = self.client_env(RAY_AUTH_MODE="token")
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                             timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(out.stdout.strip().splitlines()[-1])

    def alive_nodes(self) -> list[dict]:
        try:
            return self.query(f"""
                import json
                from ray.util.state import list_nodes
                nodes = list_nodes(address={self.dashboard_url!r}, filters=[("state", "=", "ALIVE")])
                print(json.dumps([{{"node_id": n.node_id, "is_head": n.is_head_node}} for n in nodes]))
            """)
        except (RuntimeError, subprocess.TimeoutExpired):
            return []

    def wait(self, submission_id: str) -> str:
        """The job's final status (or ``TIMEOUT`` after :data:`JOB_TIMEOUT_S`), polled every 2 s by one
        interpreter (a fresh one per poll would cost a CPU-second each, beside the job)."""
        return self.query(f"""
            import json, time
            from ray.job_submission import JobSubmissionClient
            client, deadline, status = JobSubmissionClient({self.dashboard_url!r}), time.time() + {JOB_TIMEOUT_S}, "TIMEOUT"
            while time.time() < deadline:
                state = str(client.get_job_status({submission_id!r})).split(".")[-1]
                if state in ("SUCCEEDED", "FAILED", "STOPPED"):
                    status = state
                    break
                time.sleep(2)
            print(json.dumps(status))
        """, timeout=JOB_TIMEOUT_S + 120)

    def job_logs(self, submission_id: str) -> str:
        out = subprocess.run([RAY, "job", "logs", "--address", self.dashboard_url, submission_id],
                             env=self.client_env(RAY_AUTH_MODE="token"), capture_output=True, text=True, timeout=120)
        return out.stdout + out.stderr

    def stop(self) -> list[int]:
        """End every process the cluster started, by process id: SIGTERM, then SIGKILL what is left.
        Returns the ids still alive afterwards (none expected)."""
        pids = set(_marked_pids(self.marker)) | {p.pid for p in self.procs.values() if p.poll() is None}
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 15)):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + grace
            while time.time() < deadline:
                for proc in self.procs.values():
                    proc.poll()  # reap our own children
                pids = set(_marked_pids(self.marker))
                if not pids:
                    break
                time.sleep(0.5)
        return sorted(_marked_pids(self.marker))


def _clean_env() -> dict[str, str]:
    drop = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    return {k: v for k, v in os.environ.items()
            if k not in drop and not k.startswith(("STAPO_", "VERL_", "WANDB_", "LAUNCH", "CKPT_DIR"))}


def _overrides(assets: Path, launch: Path, *extra: str) -> list[str]:
    # 2 prompts x 4 responses per step, one update: 4 sequences per rank (the least that still trains)
    overrides = cpu_overrides(assets, launch / "unused", steps=2, prompts=2, mini_batch_prompts=2, response_length=96,
                              save_freq=1, resume=True, extra=[
        # a driver joining a running cluster may not size it
        "ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null",
        "ray_kwargs.ray_init.include_dashboard=null",
        # one micro-batch per rank
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "trainer.max_actor_ckpt_to_keep=2", "recipe.token_dump.dir=dumps", *extra])
    return [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in SET_BY_COMMON]


def _submit(cluster: Cluster, assets: Path, launch: Path, *extra: str) -> subprocess.CompletedProcess:
    env = cluster.client_env(LAUNCH="submit", PYTHON=sys.executable, RAY=RAY, NNODES="2", GPUS_PER_NODE="1",
                             LOGGER="file,wandb", PROJECT=PROJECT, EXPERIMENT=EXPERIMENT, CKPT_DIR="ck",
                             WANDB_MODE="offline", WANDB_DIR=str(cluster.wandb_dir), WANDB_SILENT="true")
    return subprocess.run(["bash", str(COMMON), "stapo", "qwen3_1_7b", *_overrides(assets, launch, *extra)], cwd=launch,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def cluster_run(assets):
    # Ray's socket paths must stay short: a temp dir of its own directly under /tmp
    root = Path(tempfile.mkdtemp(prefix="stapo2n-", dir="/tmp"))
    launch = root / "launch"
    launch.mkdir()
    cluster = Cluster(root)
    result = {"cluster": cluster, "launch": launch, "run_dir": launch / "ck" / PROJECT / EXPERIMENT}
    start = time.time()
    walls = result["walls"] = {}
    try:
        cluster.start()
        walls["cluster_start"] = round(time.time() - start)
        result["nodes"] = cluster.alive_nodes()
        result["unauthenticated"] = subprocess.run(
            [RAY, "job", "list", "--address", cluster.dashboard_url], capture_output=True, text=True, timeout=120,
            env={**_clean_env(), "RAY_AUTH_MODE": "disabled", "HOME": str(root)})
        first = result["first"] = _submit(cluster, assets, launch)
        if first.returncode == 0:
            first_id = result["first_id"] = first.stdout.strip().splitlines()[-1]
            result["duplicate"] = _submit(cluster, assets, launch)
            result["first_status"] = cluster.wait(first_id)
            walls["first_job"] = round(time.time() - start)
            if result["first_status"] != "SUCCEEDED":
                result["first_logs"] = cluster.job_logs(first_id)
            result["jobs_after_duplicate"] = cluster.query(f"""
                import json
                from ray.job_submission import JobSubmissionClient
                print(json.dumps(sorted(j.submission_id for j in JobSubmissionClient({cluster.dashboard_url!r}).list_jobs()
                                        if j.submission_id)))
            """)
            result["actors"] = cluster.query(f"""
                import json
                from ray.util.state import list_actors
                actors = list_actors(address={cluster.dashboard_url!r}, limit=10000, detail=True, raise_on_missing_output=False)
                print(json.dumps([{{"class": a.class_name, "node": a.node_id, "job": a.job_id}} for a in actors]))
            """)
            result["after_first"] = {
                "metrics": (result["run_dir"] / "metrics.jsonl").read_text() if (result["run_dir"] / "metrics.jsonl").exists() else "",
                "checkpoints": sorted(p.parent.name for p in result["run_dir"].glob("global_step_*/actor")),
            }
            # what eval.sh writes beside a checkpoint: retention must leave it
            (result["run_dir"] / "global_step_1" / "merged_hf").mkdir(parents=True, exist_ok=True)
            relaunch = result["relaunch"] = _submit(cluster, assets, launch, "trainer.total_training_steps=3")
            if relaunch.returncode == 0:
                relaunch_id = result["relaunch_id"] = relaunch.stdout.strip().splitlines()[-1]
                result["relaunch_status"] = cluster.wait(relaunch_id)
                walls["relaunch_job"] = round(time.time() - start)
                result["relaunch_logs"] = cluster.job_logs(relaunch_id)
        # what the jobs wrote into Ray's copy of the project (lost with the session): files the checkout lacks
        result["written_in_working_dir"] = sorted(
            str(p) for copy in (root / "head").rglob("working_dir_files/_ray_pkg_*") for p in copy.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not (REPO / p.relative_to(copy)).exists())
        yield result
    finally:
        result["survivors"] = cluster.stop()
        walls["stopped"] = round(time.time() - start)
        print(f"[two-node] seconds since start: {walls}")
        assert not result["survivors"], f"Ray processes survived the cluster's end: {result['survivors']}"
        shutil.rmtree(root, ignore_errors=True)


def _first_ok(run) -> str:
    first = run["first"]
    assert first.returncode == 0, f"submission failed:\n{first.stderr[-4000:]}"
    assert run["first_status"] == "SUCCEEDED", f"job {run['first_id']}: {run['first_status']}\n{run.get('first_logs', '')[-6000:]}"
    return run["first_id"]


def _relaunch_ok(run) -> None:
    _first_ok(run)
    assert run["relaunch"].returncode == 0, run["relaunch"].stderr[-4000:]
    assert run["relaunch_status"] == "SUCCEEDED", f"{run['relaunch_status']}\n{run['relaunch_logs'][-6000:]}"


def test_token_authentication_is_on(cluster_run):
    assert len(cluster_run["nodes"]) == 2 and sum(n["is_head"] for n in cluster_run["nodes"]) == 1
    refused = cluster_run["unauthenticated"]
    assert refused.returncode != 0 and "Missing authentication token" in refused.stdout + refused.stderr


def test_submission_is_detached_and_named_after_the_run(cluster_run):
    first_id = _first_ok(cluster_run)
    assert first_id == wandb_run_id(PROJECT, EXPERIMENT)
    assert f"follow: ray job logs --follow --address {cluster_run['cluster'].dashboard_url} {first_id}" in \
        cluster_run["first"].stderr


def test_workers_ran_on_both_nodes(cluster_run):
    _first_ok(cluster_run)
    nodes = {n["node_id"] for n in cluster_run["nodes"]}
    jobs = {a["job"] for a in cluster_run["actors"] if "TaskRunner" in a["class"]}
    assert len(jobs) >= 1
    first_job = sorted(jobs)[0]
    # the FSDP training workers (verl's fused WorkerDict class): one per node, one rank each
    placed = [a["node"] for a in cluster_run["actors"] if "WorkerDict" in a["class"] and a["job"] == first_job]
    assert sorted(placed) == sorted(nodes), (placed, nodes, sorted({a["class"] for a in cluster_run["actors"]}))
    # verl's vLLM servers (one replica per node: tensor parallel size 1 on one GPU slot each)
    servers = [a["node"] for a in cluster_run["actors"] if "vLLMHttpServer" in a["class"] and a["job"] == first_job]
    assert sorted(servers) == sorted(nodes), (servers, nodes)


def test_a_second_submission_of_the_running_run_is_refused(cluster_run):
    first_id = _first_ok(cluster_run)
    duplicate = cluster_run["duplicate"]
    assert duplicate.returncode == 3, duplicate.stderr[-3000:]
    assert f"refused: job {first_id} of this run ({PROJECT}/{EXPERIMENT}) is" in duplicate.stderr
    assert f"ray job stop --address {cluster_run['cluster'].dashboard_url} {first_id}" in duplicate.stderr
    assert cluster_run["jobs_after_duplicate"] == [first_id]


def test_metrics_checkpoints_and_dumps_are_where_the_docs_say(cluster_run):
    _first_ok(cluster_run)
    after = cluster_run["after_first"]
    assert [json.loads(line)["step"] for line in after["metrics"].splitlines()] == [1, 2]
    assert after["checkpoints"] == ["global_step_1", "global_step_2"]
    dumps = list((cluster_run["launch"] / "dumps").rglob("*.jsonl"))
    assert dumps, "no token dump under the launch directory"
    assert cluster_run["written_in_working_dir"] == [], "run files landed in Ray's copy of the project"


def test_a_relaunch_resumes_with_every_step_once_and_retention_respected(cluster_run):
    _relaunch_ok(cluster_run)
    run_dir = cluster_run["run_dir"]
    assert cluster_run["relaunch_id"] == wandb_run_id(PROJECT, EXPERIMENT) + "-2"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3]
    # the relaunch's first rollout sampled from the step-2 checkpoint's weights, synced to vLLM at start
    assert records[2]["data"]["training/rollout_probs_diff_max"] < MAX_PROB_DIFF, records[2]["data"]
    assert "global_step_2" in cluster_run["relaunch_logs"]  # verl's resume message names the checkpoint
    assert sorted(p.parent.name for p in run_dir.glob("global_step_*/actor")) == ["global_step_2", "global_step_3"]
    assert (run_dir / "global_step_1" / "merged_hf").is_dir()
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_a_relaunch_continues_the_same_wandb_run(cluster_run):
    """Both jobs log to wandb (offline) under the run's id (the driver's ``WANDB_RUN_ID``, with
    ``WANDB_RESUME=allow``): the relaunch's records continue the first job's run at step 3."""
    _relaunch_ok(cluster_run)
    runs = offline_runs(cluster_run["cluster"].wandb_dir)
    assert len(runs) == 2, runs
    assert runs[0]["id"] == runs[1]["id"] == wandb_run_id(PROJECT, EXPERIMENT)
    assert all((run["project"], run["name"]) == (PROJECT, EXPERIMENT) for run in runs)
    assert set(runs[0]["history"]) == {1, 2} and set(runs[1]["history"]) == {3}
    assert any(key.startswith("actor/s2t/") for key in runs[1]["history"][3]), sorted(runs[1]["history"][3])
