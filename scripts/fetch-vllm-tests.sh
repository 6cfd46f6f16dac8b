#!/usr/bin/env bash
# Fetch vLLM's own scheduler tests (the peer suite, tests/vllm_peer) from the source
# distribution of each vLLM line Meridian is tested on, into the repo's gitignored .cache/.
#
# The sdist is downloaded from PyPI's file host (pinned URL and sha256 below; `pip download
# --no-binary :all:` would try to build vLLM's metadata, which needs a torch this machine does
# not have), checked, and only the files the suite imports are extracted to
# .cache/vllm-tests/<version>/tests/... (with vLLM's own __init__.py files, so they import as
# vLLM's CI imports them: `tests.v1.core.test_scheduler`). The sdist itself is not kept.
#
# Idempotent: a version whose files are complete (stamp present) is left alone. Nothing is
# written outside the repo.
#
# Usage: scripts/fetch-vllm-tests.sh [VERSION...]     (default: 0.32.0 0.33.0)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$ROOT/.cache/vllm-tests"

url_of() {
    case "$1" in
        0.32.0) echo "https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz" ;;
        0.33.0) echo "https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz" ;;
        *) return 1 ;;
    esac
}

sha256_of() {
    case "$1" in
        0.32.0) echo "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad" ;;
        0.33.0) echo "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112" ;;
        *) return 1 ;;
    esac
}

# What the suite imports: the two test modules, their helpers, and the packages around them.
FILES=(
    tests/__init__.py
    tests/v1/__init__.py
    tests/v1/core/__init__.py
    tests/v1/core/utils.py
    tests/v1/core/test_scheduler.py
    tests/v1/core/test_async_scheduler.py
    tests/v1/core/test_prefix_caching.py
    tests/v1/kv_connector/__init__.py
    tests/v1/kv_connector/unit/__init__.py
    tests/v1/kv_connector/unit/utils.py
)

fetch() {
    local version="$1" url sum dest stamp tmp
    if ! url="$(url_of "$version")" || ! sum="$(sha256_of "$version")"; then
        echo "fetch-vllm-tests: no pinned sdist for vLLM $version (known: 0.32.0, 0.33.0)" >&2
        return 1
    fi
    dest="$CACHE/$version"
    stamp="$dest/.complete"
    if [[ -f "$stamp" && "$stamp" -nt "${BASH_SOURCE[0]}" ]]; then
        echo "fetch-vllm-tests: vLLM $version tests are in ${dest#"$ROOT"/}"
        return 0
    fi
    mkdir -p "$CACHE"
    tmp="$(mktemp -d "$CACHE/.fetch-$version.XXXXXX")"
    trap 'rm -rf "$tmp"' RETURN
    echo "fetch-vllm-tests: downloading vllm-$version.tar.gz"
    curl --fail --silent --show-error --location --retry 3 --output "$tmp/sdist.tar.gz" "$url"
    if ! echo "$sum  $tmp/sdist.tar.gz" | sha256sum --check --status; then
        echo "fetch-vllm-tests: vllm-$version.tar.gz does not match its pinned sha256 $sum" >&2
        return 1
    fi
    local members=()
    for file in "${FILES[@]}"; do members+=("vllm-$version/$file"); done
    tar -xzf "$tmp/sdist.tar.gz" -C "$tmp" "${members[@]}"
    rm -rf "$dest"
    mv "$tmp/vllm-$version" "$dest"
    touch "$stamp"
    echo "fetch-vllm-tests: vLLM $version tests extracted to ${dest#"$ROOT"/}"
}

versions=("$@")
[[ ${#versions[@]} -gt 0 ]] || versions=(0.32.0 0.33.0)
for version in "${versions[@]}"; do
    fetch "$version"
done
