"""The weight sync's bounded wait (verl_patches.weight_sync): verl's sender with nobody answering
gives up after $STAPO_WEIGHT_SYNC_TIMEOUT_S with an error naming the cause, instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from tests.helpers.paths import REPO

SEND_WITHOUT_RECEIVER = textwrap.dedent("""
    import asyncio, json, sys, time
    import torch
    import stapo_cpu.activate  # the CPU path (its wing answers verl's version lookup for vLLM's CPU build)
    import verl_patches.activate  # the recipe's patch table
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender
    from verl_patches.registry import MARKER
    from verl_patches.weight_sync import WeightSyncTimeout
    folder = sys.argv[1]
    sender = BucketedWeightSender(zmq_handle=f"ipc://{folder}/sync.sock", bucket_size_mb=1, use_shm=True)
    start = time.monotonic()
    try:
        asyncio.run(sender.async_send_weights(iter([("w", torch.zeros(4))])))
        outcome = "returned"
    except WeightSyncTimeout as exc:
        outcome = str(exc)
    print(json.dumps({"outcome": outcome, "seconds": time.monotonic() - start,
                      "marked": getattr(BucketedWeightSender._init_socket, MARKER, None)}))
""")


def test_a_sync_nobody_answers_ends_with_a_clear_error(tmp_path):
    from verl_patches.weight_sync import TIMEOUT_ENV

    env = {**os.environ, "VERL_PLATFORM": "cpu", "VLLM_TARGET_DEVICE": "cpu", TIMEOUT_ENV: "1.5",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", SEND_WITHOUT_RECEIVER, str(tmp_path)], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["marked"] == "weight_sync_timeout"
    assert f"within 1.5 s ({TIMEOUT_ENV})" in result["outcome"] and "sync.sock" in result["outcome"], result
    assert 1.5 <= result["seconds"] < 10, result
    assert not (tmp_path / "sync.sock").exists()  # verl's own cleanup ran


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "inf", "1e10", "nan", "0.0001", "0.5", "2147484"])
def test_a_bad_timeout_is_refused(monkeypatch, raw):
    """``inf`` and ``1e10`` overflowed ZeroMQ's 32-bit millisecond count (OverflowError at the first
    sync); ``0.0001`` became a 0 ms socket that never waits, failing every sync."""
    from verl_patches.weight_sync import TIMEOUT_ENV, timeout_s

    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=rf"{TIMEOUT_ENV}='{raw}': expected seconds in \[1, 2147483\]"):
        timeout_s()


@pytest.mark.parametrize("raw, seconds", [("", 600.0), ("1", 1.0), (" 1.5 ", 1.5), ("2147483", 2147483.0)])
def test_every_accepted_timeout_is_a_socket_wait_zeromq_takes(monkeypatch, raw, seconds):
    import zmq

    from verl_patches.weight_sync import TIMEOUT_ENV, timeout_s

    monkeypatch.setenv(TIMEOUT_ENV, raw)
    assert timeout_s() == seconds
    with zmq.Context() as context, context.socket(zmq.REQ) as socket:
        socket.setsockopt(zmq.RCVTIMEO, int(timeout_s() * 1000))  # what the wrapped _init_socket sets
        assert socket.getsockopt(zmq.RCVTIMEO) >= 1000
