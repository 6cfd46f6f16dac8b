#!/usr/bin/env bash
# Install the real KV-transfer fabrics into the project's virtual environment (.venv):
#   - NIXL 1.5.1 with its UCX backend (nixl + nixl-cu12; the cu12 wheel bundles UCX),
#   - Mooncake's transfer engine 0.3.13.post1, CPU build (mooncake-transfer-engine-non-cuda),
#     which links Debian's libibverbs1 even for its TCP transport.
#
# Python packages are installed with --no-deps at exactly the pinned versions: `nixl`'s own
# dependencies pull in CUDA torch (its DRAM path does not need it), and Mooncake's (aiohttp,
# msgpack, requests) serve its store and HTTP tools, not the transfer engine Meridian uses.
# apt runs only when libibverbs.so.1 cannot be loaded.
#
# Idempotent: what is already there at the pinned version is left alone. Ends with a smoke
# check that both libraries start on loopback. Prints what it did.
#
# Usage: scripts/install-fabrics.sh          (VENV=/path/to/venv to target another venv)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
NIXL_PINS=(nixl==1.5.1 nixl-cu12==1.5.1)
MOONCAKE_PINS=(mooncake-transfer-engine-non-cuda==0.3.13.post1)

say() { echo "install-fabrics: $*"; }

if [[ ! -x "$PY" ]]; then
    say "no virtual environment at $VENV; create it first (make venv)"
    exit 1
fi

installed_version() {
    "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1" \
        2>/dev/null || true
}

ensure_pins() {
    local pin name want have
    local missing=()
    for pin in "$@"; do
        name="${pin%%==*}"
        want="${pin#*==}"
        have="$(installed_version "$name")"
        if [[ "$have" == "$want" ]]; then
            say "$name $have already installed"
        else
            missing+=("$pin")
            say "$name ${have:-missing}: installing $want"
        fi
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        # Drop one warning per package that this machine's extra-index configuration causes.
        "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps "${missing[@]}" \
            2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    fi
}

if "$PY" -c "import ctypes; ctypes.CDLL('libibverbs.so.1')" 2>/dev/null; then
    say "libibverbs.so.1 present"
else
    say "libibverbs.so.1 missing: installing Debian's libibverbs1"
    sudo_=()
    if [[ "$(id -u)" -ne 0 ]]; then
        if ! command -v sudo >/dev/null; then
            say "not root and no sudo: run 'apt-get install libibverbs1' as root, then rerun"
            exit 1
        fi
        sudo_=(sudo)
    fi
    "${sudo_[@]}" apt-get update -qq
    "${sudo_[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
    say "installed libibverbs1"
fi

ensure_pins "${NIXL_PINS[@]}"
ensure_pins "${MOONCAKE_PINS[@]}"

# Both libraries must load and start here, not merely be installed.
"$PY" - <<'EOF'
from meridian.disagg.mooncake_fabric import load_mooncake, start_engine
from meridian.disagg.nixl_fabric import NixlProducerPlane

plane = NixlProducerPlane()
plane.close()
engine = start_engine(load_mooncake(), "127.0.0.1")
print(f"install-fabrics: NIXL agent (UCX) and Mooncake engine (TCP, port {engine.get_rpc_port()}) start fine")
EOF
