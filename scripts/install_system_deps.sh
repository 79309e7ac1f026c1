#!/usr/bin/env bash
# Install the system packages the sandbox needs (bubblewrap).
#
# Safe to run repeatedly: does nothing when bwrap is already on PATH, and exits 0
# with a clear message when it cannot install (not root, no apt-get). The sandbox
# itself raises a clear error at use time if bwrap is still missing.
set -euo pipefail

if command -v bwrap >/dev/null 2>&1; then
    echo "install_system_deps: bubblewrap already present: $(command -v bwrap) ($(bwrap --version 2>/dev/null || echo 'version unknown'))"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: apt-get not found; install bubblewrap with your package manager" \
         "(e.g. 'dnf install bubblewrap', 'pacman -S bubblewrap'). Skipping." >&2
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "install_system_deps: not root; run 'sudo apt-get update && sudo apt-get install -y bubblewrap'" \
         "or rerun this script as root. Skipping." >&2
    exit 0
fi

echo "install_system_deps: installing bubblewrap with apt-get"
export DEBIAN_FRONTEND=noninteractive
if apt-get update && apt-get install -y --no-install-recommends bubblewrap; then
    echo "install_system_deps: installed $(command -v bwrap) ($(bwrap --version))"
else
    echo "install_system_deps: apt-get failed to install bubblewrap (no network or no such package?)." \
         "The sandbox will refuse to start until 'bwrap' is on PATH." >&2
    exit 0
fi
