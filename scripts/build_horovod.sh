#!/usr/bin/env bash
# Build Horovod 0.28.1 (the only release on PyPI, an sdist) for CPU/Gloo against the torch
# installed in $PY's environment, and install it there. The built wheel is cached per machine,
# keyed on the torch version it was compiled against, so a second run installs in seconds.
#
# Why a patch: 0.28.1's CMakeLists.txt and horovod/torch/CMakeLists.txt pin CMAKE_CXX_STANDARD 14;
# torch >= 2.1 headers need C++17 ("C++17 or later compatible compiler is required"). Upstream
# fixed this on master after 0.28.1 and has not released since.
set -euo pipefail
PY=${PY:-.venv/bin/python}
HVD_VERSION=${HVD_VERSION:-0.28.1}
CACHE=${AMPGUARD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ampguard/wheels}

if "$PY" -c "import horovod.torch" 2>/dev/null; then
    echo "horovod: already installed in $("$PY" -c 'import sys; print(sys.prefix)')"
    exit 0
fi
TORCH=$("$PY" -c "import torch; print(torch.__version__.replace('+', '_'))")
PYTAG=$("$PY" -c "import sys; print(f'cp{sys.version_info.major}{sys.version_info.minor}')")
KEYDIR="$CACHE/horovod-$HVD_VERSION-torch$TORCH-$PYTAG"
mkdir -p "$KEYDIR"
WHEEL=$(ls "$KEYDIR"/horovod-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$WHEEL" ]; then
    echo "horovod: building $HVD_VERSION for torch $TORCH (about 5 minutes on 2 cores; cached in $KEYDIR)"
    command -v cmake >/dev/null || "$PY" -m pip install -q cmake
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary=:all: "horovod==$HVD_VERSION" -d "$WORK"
    tar -xzf "$WORK"/horovod-"$HVD_VERSION".tar.gz -C "$WORK"
    SRC="$WORK/horovod-$HVD_VERSION"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/CMakeLists.txt" || { echo "horovod: C++17 patch did not apply" >&2; exit 1; }
    # Build-time requirements that --no-build-isolation does not fetch.
    "$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
    MAKEFLAGS="-j$(nproc)" HOROVOD_BUILD_ARCH_FLAGS="" \
        "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$SRC"
    cp "$WORK"/dist/horovod-*.whl "$KEYDIR/"
    WHEEL=$(ls "$KEYDIR"/horovod-*.whl | head -n1)
fi
"$PY" -m pip install -q --no-deps "$WHEEL"
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi
"$PY" -c "import horovod.torch as hvd; print('horovod', hvd.__version__ if hasattr(hvd, '__version__') else '', 'installed')"
