#!/usr/bin/env bash
# Build .venv-vllm-gpu: the GPU build of vLLM (vllm 0.33.0 from PyPI) plus Meridian, layered
# over .venv-vllm, so that vLLM's own Scheduler / AsyncScheduler code of that release runs on
# a machine without a GPU. Only the scheduler is meant to run here: the CUDA kernels
# (vllm._C_stable_libtorch; 0.33 has no vllm._C) do not load, and nothing on the scheduling path
# needs them; build configs with DeviceConfig(device="cpu").
#
# Layering: a venv without pip of its own whose site-packages holds only vllm 0.33.0 (and
# Meridian's editable hook); a .pth file there adds .venv-vllm's site-packages *after* it, so
# torch 2.13.0+cpu, pip, setuptools and every vLLM dependency come from .venv-vllm, while
# `import vllm` and importlib.metadata.version("vllm") see 0.33.0 (vllm-cpu's metadata is
# named vllm-cpu, and its vllm/ package comes later on sys.path). .venv-vllm is not modified.
#
# Idempotent: a complete environment (stamp newer than the lock, pyproject.toml, this script
# and .venv-vllm's stamp) is left alone. The version is pinned, with hashes, in
# requirements-vllm-gpu.lock and installed with --no-deps.
#
# Usage: scripts/install-vllm-gpu-sched.sh          (needs .venv-vllm: make vllm-venv)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="$ROOT/.venv-vllm"
BASE_PY="$BASE/bin/python"
BASE_STAMP="$BASE/.installed"
VENV="$ROOT/.venv-vllm-gpu"
PY="$VENV/bin/python"
LOCK="$ROOT/requirements-vllm-gpu.lock"
STAMP="$VENV/.installed"
LAYER_PTH="_meridian_vllm_cpu_base.pth"

pip_() {
    # Drop one warning per package that this machine's extra-index configuration causes.
    "$PY" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [[ ! -x "$BASE_PY" || ! -f "$BASE_STAMP" ]]; then
    echo "install-vllm-gpu-sched: $BASE is missing or incomplete; run 'make vllm-venv' first" >&2
    exit 1
fi

if [[ -f "$STAMP" && "$STAMP" -nt "$LOCK" && "$STAMP" -nt "$ROOT/pyproject.toml" \
    && "$STAMP" -nt "$BASE_STAMP" && "$STAMP" -nt "${BASH_SOURCE[0]}" ]]; then
    echo "install-vllm-gpu-sched: $VENV is up to date"
    exit 0
fi

start=$SECONDS
if [[ ! -x "$PY" ]]; then
    echo "install-vllm-gpu-sched: creating $VENV over $BASE"
    # Same interpreter as .venv-vllm; pip and setuptools come from .venv-vllm via the layer.
    "$BASE_PY" -m venv --without-pip "$VENV"
fi

purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
base_site="$(purelib "$BASE_PY")"
own_site="$(purelib "$PY")"
# site.addsitedir appends .venv-vllm's site-packages after this venv's own (and runs its .pth
# files, as its own interpreter would).
echo "import site; site.addsitedir('$base_site')" >"$own_site/$LAYER_PTH"

echo "install-vllm-gpu-sched: installing the version pinned in $(basename "$LOCK") (--no-deps)"
pip_ install --quiet --no-deps --require-hashes -r "$LOCK"
# (its own site-packages first: the distribution's old name, if an earlier install left it)
if [[ -n "$(ls -d "$own_site"/meridian-*.dist-info 2>/dev/null)" ]]; then
    pip_ uninstall --quiet --yes meridian
fi
pip_ install --quiet --no-deps --no-build-isolation -e "$ROOT"

VLLM_LOGGING_LEVEL=ERROR "$PY" -c "
import importlib.metadata as md, os
import vllm, meridian, torch
import vllm.v1.core.sched.scheduler, vllm.v1.core.sched.async_scheduler
venv = os.path.realpath('$VENV')
assert os.path.realpath(vllm.__file__).startswith(venv + os.sep), f'vllm leaks from {vllm.__file__}'
assert md.version('vllm') == vllm.__version__, (md.version('vllm'), vllm.__version__)
try:  # the CUDA kernels: expected to fail without libcuda, not needed to schedule
    import vllm._C_stable_libtorch  # noqa: F401
    c_ext = 'loads'
except ImportError as e:
    c_ext = 'does not load (' + str(e).splitlines()[0] + '), not needed'
print('install-vllm-gpu-sched: vllm', vllm.__version__, 'torch', torch.__version__,
      '- scheduler imports fine; vllm._C_stable_libtorch', c_ext)
" 2> >(grep -v "Triton is installed" >&2)
touch "$STAMP"
echo "install-vllm-gpu-sched: done in $((SECONDS - start)) s, $VENV is $(du -sh "$VENV" | cut -f1)" \
    "(plus .venv-vllm, shared)"
