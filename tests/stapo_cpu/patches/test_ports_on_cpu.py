"""The CPU path's worker-group master port (stapo_cpu.patches.ports): drawn below the kernel's
ephemeral range, never one that is taken, and verl's remote function patched in a verl process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from stapo_cpu.patches import ports
from stapo_cpu.trainer import EXTERNAL_MODULES
from tests.helpers.paths import REPO


def _listener() -> tuple[socket.socket, int]:
    """A socket listening on a port of the picked range (the event: a port someone else holds)."""
    for port in range(ports.LOW + 7000, ports.LOW + 8000):
        s = socket.socket()
        try:
            s.bind(("", port))
        except OSError:
            s.close()
            continue
        s.listen()
        return s, port
    pytest.fail("no free port to hold between 27000 and 28000")


def test_the_port_is_below_the_ephemeral_range_and_binds():
    low, _ = ports.ephemeral_range()
    picked = {ports.master_port() for _ in range(20)}
    assert None not in picked
    assert all(ports.LOW <= p < low for p in picked), (picked, low)
    assert len(picked) > 1  # drawn at random: runs starting together pick different ports
    assert all(ports.binds(p) for p in picked)


def test_a_taken_port_is_skipped():
    held, port = _listener()
    with held:
        draws = iter([port, port, port + 1 if ports.binds(port + 1) else port + 2])
        assert not ports.binds(port)
        assert ports.master_port(ephemeral=(32768, 60999), randrange=lambda a, b: next(draws)) in (port + 1, port + 2)


def test_no_room_below_the_ephemeral_range_keeps_verls_choice():
    assert ports.master_port(ephemeral=(ports.LOW + ports.MIN_SPAN - 1, 60999)) is None
    assert ports.master_port(ephemeral=(1024, 60999)) is None


def test_every_pick_taken_gives_up():
    held, port = _listener()
    with held:
        assert ports.master_port(ephemeral=(32768, 60999), randrange=lambda a, b: port, tries=5) is None


def test_an_unreadable_range_file_gives_none(tmp_path):
    assert ports.ephemeral_range(str(tmp_path / "missing")) is None
    (tmp_path / "bad").write_text("not ports\n")
    assert ports.ephemeral_range(str(tmp_path / "bad")) is None
    (tmp_path / "ok").write_text("32768\t60999\n")
    assert ports.ephemeral_range(str(tmp_path / "ok")) == (32768, 60999)


PROBE = textwrap.dedent(
    """
    import json
    import verl
    from verl.single_controller.ray import base
    remote = base.get_master_addr_port
    # the function Ray runs on the worker group's node (no cluster needed to call it here)
    addr, port = remote._function()
    ranged = remote._function(master_port_range=[{low}, {high}])
    print(json.dumps({{"patch": getattr(remote, "__stapo_patch__", None), "remote": hasattr(remote, "options"),
                       "port": int(port), "ranged": int(ranged[1])}}))
    """
)


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu-path", "off-the-cpu-path"])
def test_verls_remote_function_picks_with_the_patch_on_the_cpu_path_only(cpu):
    """In a verl process (both patch tables loaded by ``import verl``): on the CPU path verl's remote
    function (still a Ray remote function) draws the master port from below the ephemeral range; a
    given ``master_port_range`` is still verl's to search; without VERL_PLATFORM=cpu verl's function
    is untouched."""
    low, _ = ports.ephemeral_range()
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "RAY_ADDRESS")}
    env.update(VERL_USE_EXTERNAL_MODULES=",".join(EXTERNAL_MODULES), PYTHONPATH=str(REPO))
    if cpu:
        env["VERL_PLATFORM"] = "cpu"
    probe = PROBE.format(low=40000, high=40100)
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["remote"] and 40000 <= out["ranged"] < 40100
    if cpu:
        assert out["patch"] == "cpu_master_port" and ports.LOW <= out["port"] < low, out
    else:
        assert out["patch"] is None, out
