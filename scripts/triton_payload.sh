#!/usr/bin/env bash
# Another Triton on the GPU machine, which has no network and takes at most 64 MiB a call.
#
# Here (with network):   bash scripts/triton_payload.sh build VERSION
#   downloads Triton VERSION's wheel for the GPU machine's Python (3.12, manylinux x86_64), keeps
#   what running kernels on an NVIDIA GPU needs (the Python package, libtriton, the ptxas that
#   compiles for sm_90 (the wheel's ptxas up to 3.8, its ptxas-blackwell, CUDA 13, from 3.9 on:
#   nvidia/compiler.py's get_ptxas), cuobjdump, nvdisasm, the headers and libdevice; not proton,
#   CUPTI, the other ptxas or the AMD backend, whose entry point goes too), packs it with xz and
#   cuts it into parts of at most 60 MB under .triton-VERSION/part-aa, -ab, ... (git ignores
#   .triton-*; each part is carried by one call).
# On the GPU machine, on one warm machine (the machine is released after ~30 s idle):
#   call i (carry [".triton-VERSION/part-XX"]):  bash scripts/triton_payload.sh stash VERSION
#     copies the part that came with the call to /tmp/triton-VERSION-parts;
#   then, in the call that runs (any carry):     source scripts/triton_payload.sh use VERSION
#     joins the parts (once all are stashed), unpacks to /tmp/triton-VERSION and puts it first
#     on PYTHONPATH, so that `import triton` finds VERSION (torch keeps its own).

action=${1:-}
version=${2:-}
if [ -z "$action" ] || [ -z "$version" ]; then
    echo "usage: triton_payload.sh build|stash|use VERSION" >&2
    return 2 2>/dev/null || exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
parts_here="$root/.triton-$version"
stash=/tmp/triton-$version-parts
target=/tmp/triton-$version
case "$action" in
  build)
    work=$(mktemp -d)
    python3 -m pip download -q "triton==$version" --no-deps --only-binary=:all: \
        --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$work" || exit 1
    (cd "$work" && python3 -m zipfile -e triton-*.whl tree) || exit 1
    nvidia="$work/tree/triton/backends/nvidia"
    # Which ptxas sm_90 gets: "ptxas_blackwell if arch >= 100" (3.7, 3.8) or "if arch < 90:
    # ... ptxas" (3.9); keep that one.
    if grep -q "if arch < 90:" "$nvidia/compiler.py"; then other=ptxas; else other=ptxas-blackwell; fi
    rm -rf "$nvidia"/lib/cupti* "$nvidia/bin/$other" "$work"/tree/triton/_C/libproton.so \
        "$work"/tree/triton/backends/amd
    sed -i '/triton\.backends\.amd/d' "$work"/tree/triton-*.dist-info/entry_points.txt
    rm -rf "$parts_here" && mkdir -p "$parts_here"
    tar -C "$work/tree" -cf - . | xz -9 -T0 | split -b 60000000 - "$parts_here/part-"
    rm -rf "$work"
    ls -l "$parts_here" ;;
  stash)
    mkdir -p "$stash"
    found=0
    for p in "$parts_here"/part-*; do
        [ -f "$p" ] && cp "$p" "$stash/" && found=1 && echo "triton $version: stashed $(basename "$p")"
    done
    [ "$found" = 1 ] || { echo "triton $version: no part came with this call"; exit 3; } ;;
  use)
    if [ ! -f "$target/triton/__init__.py" ]; then
        mkdir -p "$stash"
        for p in "$parts_here"/part-*; do [ -f "$p" ] && cp "$p" "$stash/"; done
        mkdir -p "$target"
        if ! cat "$stash"/part-* 2>/dev/null | xz -dc | tar -C "$target" -xf -; then
            echo "triton $version: parts missing or broken in $stash (machine went cold?)"
            rm -rf "$target"
            return 3 2>/dev/null || exit 3
        fi
    fi
    # The wheel's zip keeps no file modes: the tools must be executable (ptxas, cuobjdump, ...).
    chmod +x "$target"/triton/backends/nvidia/bin/* 2>/dev/null
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
    echo "triton $version: $(python3 -c 'import triton; print(triton.__version__, triton.__file__)')" ;;
  *)
    echo "usage: triton_payload.sh build|stash|use VERSION" >&2
    return 2 2>/dev/null || exit 2 ;;
esac
