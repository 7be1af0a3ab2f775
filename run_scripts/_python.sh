# Sourced by the run scripts from the repository's root; sets `python`, the interpreter they run the
# recipe with: PYTHON when set; else python3 when it has the recipe's requirements (an activated
# environment, a cluster's install); else the project's .venv (run_scripts/test.sh and quickstart.sh
# make it), whether or not the shell activated it. An interpreter found on PATH that is not the
# project's .venv is named on stderr; with none that has the requirements it stops and says how to get one.
if [ -n "${PYTHON:-}" ]; then
  python=$PYTHON
elif python3 -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("omegaconf") and u.find_spec("verl")))' \
     >/dev/null 2>&1; then
  python=python3
  case "$(command -v python3)" in
    "$PWD/.venv/bin/"*) ;;
    *) echo "[stapo] python: $(command -v python3) (python3 on PATH, not the project's .venv; PYTHON chooses another)" >&2 ;;
  esac
elif [ -x .venv/bin/python ]; then
  python=$PWD/.venv/bin/python
else
  echo "error: python3 ($(command -v python3 || echo none on PATH)) lacks the recipe's requirements (omegaconf, verl)" \
       "and there is no $PWD/.venv: create it with 'bash run_scripts/test.sh' (the CPU stack), install" \
       "requirements.txt into python3 (docs/cluster.md), or set PYTHON to an interpreter that has them" >&2
  exit 2
fi
