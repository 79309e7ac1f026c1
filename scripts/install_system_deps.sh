#!/usr/bin/env bash
# Install the system packages the sandbox needs: bubblewrap (>= 0.8, for --disable-userns), tini
# (the sandbox's pid 1) and libseccomp2 (the library the pyseccomp bindings load to build the
# seccomp filter); for the tests, strace (tests/sandbox/test_fd_ownership.py traces every close(2) of a
# sandbox workload: a refused close is an fd closed twice); and what the dashboard's browser test drives:
# chromium, its chromedriver and a font (fonts-liberation: text in the screenshots).
#
# Safe to run repeatedly: does nothing when everything is already present, and exits 0 with a
# clear message when it cannot install (not root, no apt-get). The sandbox itself raises a clear
# error at use time if something is still missing.
set -euo pipefail

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v tini >/dev/null 2>&1 || command -v tini-static >/dev/null 2>&1 || missing+=(tini)
ldconfig -p 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null || missing+=(libseccomp2)  # no -q: with pipefail, grep -q closing the pipe early fails ldconfig (SIGPIPE)
command -v strace >/dev/null 2>&1 || missing+=(strace)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
[ -d /usr/share/fonts/truetype/liberation ] || missing+=(fonts-liberation)

if [ ${#missing[@]} -eq 0 ]; then
    echo "install_system_deps: bubblewrap, tini, libseccomp2, strace and chromium already present: $(command -v bwrap)" \
         "($(bwrap --version 2>/dev/null || echo 'version unknown'))"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_system_deps: apt-get not found; install ${missing[*]} with your package manager" \
         "(e.g. 'dnf install ${missing[*]}'). Skipping." >&2
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "install_system_deps: not root; run 'sudo apt-get update && sudo apt-get install -y ${missing[*]}'" \
         "or rerun this script as root. Skipping." >&2
    exit 0
fi

echo "install_system_deps: installing ${missing[*]} with apt-get"
export DEBIAN_FRONTEND=noninteractive
if apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; then
    echo "install_system_deps: installed ${missing[*]}"
else
    echo "install_system_deps: apt-get failed to install ${missing[*]} (no network or no such package?)." \
         "The sandbox will refuse to start until they are present." >&2
    exit 0
fi
