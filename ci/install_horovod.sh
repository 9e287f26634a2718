#!/usr/bin/env bash
# Install Horovod 0.28.1 (PyTorch frontend, Gloo + MPI controllers, CPU only)
# into the current Python environment.
#
# Idempotent: exits quickly if `import horovod.torch` already works.
# Intended for CI / fresh Debian machines running as root; torch must already
# be installed (pinned, CPU build) because Horovod compiles against it.
#
# Environment overrides:
#   PYTHON           interpreter to install into (default: python3)
#   HOROVOD_VERSION  Horovod version to build   (default: 0.28.1)
set -euo pipefail

PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"

log() { echo "[install_horovod] $*" >&2; }

summary() {
    # horovodrun lives next to the interpreter; it may not be on PATH in venvs.
    local bindir horovodrun version check
    bindir="$("$PYTHON" -c 'import sys, os; print(os.path.dirname(sys.executable))')"
    horovodrun="$bindir/horovodrun"
    [[ -x "$horovodrun" ]] || horovodrun="horovodrun"
    version="$("$PYTHON" -c 'import horovod; print(horovod.__version__)')"
    check="$("$horovodrun" --check-build)"
    # Collapse the "[X] name" lines of one --check-build section into "a,b".
    section() {
        sed -n "/$1/,/$2/p" <<<"$check" | sed -n 's/^ *\[X\] *\([^ ]*\).*/\1/p' | paste -sd, -
    }
    local frameworks controllers ops
    frameworks="$(section 'Available Frameworks' 'Available Controllers')"
    controllers="$(section 'Available Controllers' 'Available Tensor Operations')"
    ops="$(section 'Available Tensor Operations' '$^')"
    echo "horovod ${version}: frameworks=[${frameworks}] controllers=[${controllers}] tensor_ops=[${ops}]"
}

if "$PYTHON" -c 'import horovod.torch' >/dev/null 2>&1; then
    log "horovod.torch already importable; skipping build"
    summary
    exit 0
fi

if ! "$PYTHON" -c 'import torch' >/dev/null 2>&1; then
    log "ERROR: torch is not importable by $PYTHON; install it first (pinned, CPU build)"
    exit 1
fi

# --- System dependencies --------------------------------------------------
# Open MPI provides both the MPI controller and mpicc/mpirun for mpi4py;
# Debian's cmake (3.25) avoids pip's CMake 4, which rejects Horovod's files.
apt_pkgs=()
command -v mpicc  >/dev/null 2>&1 || apt_pkgs+=(libopenmpi-dev)
command -v mpirun >/dev/null 2>&1 || apt_pkgs+=(openmpi-bin)
command -v cmake  >/dev/null 2>&1 || apt_pkgs+=(cmake)
command -v g++    >/dev/null 2>&1 || apt_pkgs+=(g++)
command -v make   >/dev/null 2>&1 || apt_pkgs+=(make)
if ((${#apt_pkgs[@]})); then
    log "apt-get install ${apt_pkgs[*]}"
    SUDO=""
    if [[ "$(id -u)" -ne 0 ]]; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}"
fi

# --no-build-isolation (needed so the build sees the installed torch) means the
# build backend's own requirements must already be present.
"$PYTHON" -m pip install -q setuptools wheel packaging
# Not needed by Horovod itself, but the project uses mpi4py alongside it, and
# building it here guarantees it links against the same Open MPI.
"$PYTHON" -m pip install -q mpi4py

# --- Build environment ----------------------------------------------------
workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

# Horovod forces C++14 (and C++11 for some deps), but current torch headers
# require C++17. CMAKE_CXX_STANDARD is hard-coded in its CMakeLists, so rewrite
# the flag at the compiler level instead of patching the sdist.
cat >"$workdir/cxx17" <<'EOF'
#!/usr/bin/env bash
args=()
for a in "$@"; do
    case "$a" in
        -std=c++11|-std=c++14|-std=gnu++11|-std=gnu++14) args+=("-std=c++17") ;;
        *) args+=("$a") ;;
    esac
done
exec g++ "${args[@]}"
EOF
chmod +x "$workdir/cxx17"
export CXX="$workdir/cxx17"
export CC="${CC:-gcc}"

# Harmless on CMake 3.x; lets CMake >= 4 accept Horovod's old
# cmake_minimum_required() calls (in bundled third-party deps too).
export CMAKE_POLICY_VERSION_MINIMUM=3.5

# Horovod's setup.py defaults to `make -j8`, which can exhaust memory on
# small CI runners when compiling against torch headers; only used if unset.
export MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}"

export HOROVOD_WITH_PYTORCH=1
export HOROVOD_WITHOUT_TENSORFLOW=1
export HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_GLOO=1
export HOROVOD_WITH_MPI=1

log "building horovod==${HOROVOD_VERSION} (takes a few minutes)"
start=$SECONDS
"$PYTHON" -m pip install --no-build-isolation --no-cache-dir "horovod==${HOROVOD_VERSION}"
log "build finished in $((SECONDS - start))s"

# Fail loudly here rather than at first use in tests.
"$PYTHON" -c 'import horovod.torch'
summary
