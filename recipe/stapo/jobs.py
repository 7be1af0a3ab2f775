"""Submission ids of ``LAUNCH=submit`` (``run_scripts/common.sh``): one run, one id, one job at a time.

A run (project + experiment) has a fixed id, :func:`recipe.stapo.driver.wandb_run_id`: the
wandb run id, and the Ray submission id of its first job. Ray never reuses a submission id (a
finished job keeps its id), so a relaunch, the way a run resumes, is submitted as ``<id>-2``,
``<id>-3``... While any job of the run is pending or running, a new one is refused: two jobs would
write the same checkpoint folder and the same wandb run. The cluster is asked through Ray's own job
client, so Ray's token authentication applies (docs/cluster.md).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Iterable, Optional, Sequence

from recipe.stapo.driver import wandb_run_id

#: exit status of ``next-id`` when a job of the run is still pending or running
RUNNING_EXIT = 3
#: Ray job states in which a job may still write (``ray.job_submission.JobStatus``)
ACTIVE_STATES = ("PENDING", "RUNNING")


class JobRunning(RuntimeError):
    """A job of the run is pending or running; ``submission_id`` names it."""

    def __init__(self, submission_id: str, status: str):
        super().__init__(f"job {submission_id} of this run is {status}")
        self.submission_id, self.status = submission_id, status


def launch_number(submission_id: str, base: str) -> Optional[int]:
    """1 for ``base``, ``k`` for ``base-k`` (k >= 2), None for a job of another run."""
    if submission_id == base:
        return 1
    match = re.fullmatch(re.escape(base) + r"-(\d+)", submission_id)
    return int(match.group(1)) if match and int(match.group(1)) >= 2 else None


def next_submission_id(jobs: Iterable[tuple[str, str]], base: str) -> str:
    """The id of the run's next job, given the cluster's jobs as ``(submission_id, status)`` pairs.

    Raises :class:`JobRunning` if a job of the run is pending or running.
    """
    launches = []
    for submission_id, status in jobs:
        number = launch_number(submission_id or "", base)
        if number is None:
            continue
        if str(status).split(".")[-1] in ACTIVE_STATES:
            raise JobRunning(submission_id, str(status).split(".")[-1])
        launches.append(number)
    return base if not launches else f"{base}-{max(launches) + 1}"


def cluster_jobs(address: str) -> list[tuple[str, str]]:
    """``(submission_id, status)`` of every job the cluster at ``address`` (its dashboard) knows."""
    from ray.job_submission import JobSubmissionClient  # ray loads only when a cluster is asked, not for --help

    client = JobSubmissionClient(address)
    return [(job.submission_id, str(job.status)) for job in client.list_jobs() if job.submission_id]


def follow_commands(submission_id: str, address: str) -> str:
    """How to follow, check and stop a job (printed by ``common.sh`` and on refusal)."""
    return (f"  follow: ray job logs --follow --address {address} {submission_id}\n"
            f"  status: ray job status --address {address} {submission_id}\n"
            f"  stop:   ray job stop --address {address} {submission_id}")


def _main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipe.stapo.jobs")
    sub = parser.add_subparsers(dest="command", required=True)
    nxt = sub.add_parser("next-id", help="the submission id of the run's next job")
    nxt.add_argument("--project", required=True)
    nxt.add_argument("--experiment", required=True)
    nxt.add_argument("--address", help="the cluster's dashboard, http://<head>:8265")
    nxt.add_argument("--offline", action="store_true", help="the run's id, without asking the cluster")
    args = parser.parse_args(argv)

    base = wandb_run_id(args.project, args.experiment)  # the id of the run's first job
    if args.offline:
        print(base)
        return 0
    if not args.address:
        parser.error("next-id needs --address (or --offline)")
    try:
        jobs = cluster_jobs(args.address)
    except Exception as exc:  # unreachable dashboard, refused token...: Ray's own message says which
        print(f"[stapo] cannot list the jobs of the Ray cluster at {args.address}: {exc}", file=sys.stderr)
        return 1
    try:
        print(next_submission_id(jobs, base))
    except JobRunning as running:
        print(f"[stapo] refused: job {running.submission_id} of this run ({args.project}/{args.experiment}) is "
              f"{running.status}; a second one would write the same checkpoints and wandb run.\n"
              f"{follow_commands(running.submission_id, args.address)}", file=sys.stderr)
        return RUNNING_EXIT
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
