#!/usr/bin/env bash
# Sourced by scripts/install.sh, demo.sh and test.sh: sets PY to the Python that echoloss is
# installed into and run with, and says which one it is (on stderr).
#
#   1. $PYTHON when set (any interpreter you name: a conda env, a pyenv version, ...);
#   2. the active virtual environment ($VIRTUAL_ENV, or $CONDA_PREFIX for conda);
#   3. otherwise the project environment .venv (created on first use).
#
# Why a project environment: Debian/Ubuntu's system Python refuses `pip install` outside a
# virtual environment (PEP 668, "externally-managed-environment"), and installing into some
# other global Python would change it behind its owner's back. .venv is created with
# --system-site-packages so that an installed torch (several hundred MB, or GB with CUDA) is
# reused rather than downloaded again; everything pip installs goes into .venv.
# ECHOLOSS_VENV overrides the location; ECHOLOSS_BASE_PYTHON picks the interpreter it is made from.

_echoloss_say() { echo "[echoloss] $*" >&2; }

# 0 when "$1" is a Python that echoloss supports (3.10 or newer).
_echoloss_supported() {
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1
}

_echoloss_base_python() {
    local c
    if [ -n "${ECHOLOSS_BASE_PYTHON:-}" ]; then  # asked for by name: that one or an error
        if _echoloss_supported "$ECHOLOSS_BASE_PYTHON"; then
            command -v "$ECHOLOSS_BASE_PYTHON"
            return 0
        fi
        _echoloss_say "ECHOLOSS_BASE_PYTHON=$ECHOLOSS_BASE_PYTHON is not a Python >= 3.10"
        return 1
    fi
    for c in python3 python3.12 python3.11 python3.10 python; do
        if command -v "$c" >/dev/null 2>&1 && _echoloss_supported "$c"; then
            command -v "$c"
            return 0
        fi
    done
    return 1
}

# Bootstraps pip into a venv made with --without-pip: Debian/Ubuntu ship `venv` without
# `ensurepip` unless python3-venv is installed, which needs root. Uses the base Python's pip when
# it has one, else downloads the pip wheel from PyPI and checks its sha256 (standard library only).
_echoloss_bootstrap_pip() {
    local base="$1" venv_py="$2"
    if "$base" -m pip --version >/dev/null 2>&1 \
        && "$base" -m pip --python "$venv_py" install -q pip >/dev/null 2>&1; then
        return 0
    fi
    "$venv_py" - <<'PYEOF'
import hashlib, json, os, subprocess, sys, tempfile, urllib.parse, urllib.request

with urllib.request.urlopen("https://pypi.org/pypi/pip/json", timeout=60) as r:
    info, base = json.load(r), r.geturl()
wheel = next(u for u in info["urls"] if u["packagetype"] == "bdist_wheel")
with urllib.request.urlopen(urllib.parse.urljoin(base, wheel["url"]), timeout=300) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != wheel["digests"]["sha256"]:
    sys.exit(f"pip wheel from {wheel['url']}: sha256 mismatch, not installing it")
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, wheel["filename"])
    with open(path, "wb") as f:
        f.write(data)
    # A pip wheel runs from the zip: python pip-X.whl/pip install pip-X.whl
    subprocess.run([sys.executable, os.path.join(path, "pip"), "install", "-q", path], check=True)
PYEOF
}

_echoloss_make_venv() {
    local dir="$1" base
    if ! base="$(_echoloss_base_python)"; then
        _echoloss_say "no Python >= 3.10 to create $dir from (tried \$ECHOLOSS_BASE_PYTHON, or python3, python3.12, python3.11, python3.10, python)."
        _echoloss_say "Install one (e.g. 'apt install python3' on Debian 12 / Ubuntu 22.04+), or set PYTHON=/path/to/python."
        return 1
    fi
    _echoloss_say "creating the project environment $dir from $base ($("$base" -c 'import platform; print(platform.python_version())'))"
    if [ -z "${ECHOLOSS_VENV_NO_ENSUREPIP:-}" ] \
        && "$base" -m venv --system-site-packages "$dir" >/dev/null 2>&1; then
        :
    else
        _echoloss_say "venv without ensurepip (no python3-venv package?): bootstrapping pip"
        rm -rf "$dir"
        "$base" -m venv --system-site-packages --without-pip "$dir"
        _echoloss_bootstrap_pip "$base" "$dir/bin/python"
    fi
}

_echoloss_select_python() {
    if [ -n "${PYTHON:-}" ]; then
        PY="$PYTHON"
        # install.sh, called from demo.sh/test.sh, inherits the choice: say it once
        [ -n "${_ECHOLOSS_PY_SAID:-}" ] || _echoloss_say "using \$PYTHON: $PY"
    elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
        PY="$VIRTUAL_ENV/bin/python"
        _echoloss_say "using the active virtual environment $VIRTUAL_ENV"
    elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
        PY="$CONDA_PREFIX/bin/python"
        _echoloss_say "using the active conda environment $CONDA_PREFIX"
    else
        local dir="${ECHOLOSS_VENV:-.venv}"
        if [ ! -x "$dir/bin/python" ] || ! "$dir/bin/python" -m pip --version >/dev/null 2>&1; then
            _echoloss_make_venv "$dir" || return 1
        fi
        PY="$(cd "$dir" && pwd)/bin/python"
        _echoloss_say "using the project environment $dir ($("$PY" -c 'import sys; print(sys.version.split()[0])')); activate it with: source $dir/bin/activate"
    fi
    if ! _echoloss_supported "$PY"; then
        _echoloss_say "$PY is Python $("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'); echoloss needs 3.10 or newer."
        return 1
    fi
    # The scripts below call the same Python again (install.sh from demo.sh): choose once.
    export PYTHON="$PY" _ECHOLOSS_PY_SAID=1
}

_echoloss_select_python
