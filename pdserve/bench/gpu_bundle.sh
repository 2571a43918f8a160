#!/usr/bin/env bash
# Packs what a lent GPU machine lacks into .gpu/ (no registry is reachable there), for
# bench/gpu_check.sh: pdserve's own wheel, FlashInfer (its kernel sources, without the
# sub-projects the attention kernels never include: 62 MB wheel -> ~13 MB), NIXL for CUDA 13
# (without its expert-parallel library: 59 MB wheel -> ~17 MB), and the few small packages the
# machine's image does not hold (py-spy: the host-side profile of a decode step, gpu_check.sh). Python 3.12 x86_64, matching that image.
#
#   make gpu-bundle              # or: bash bench/gpu_bundle.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-${PYTHON:-.venv/bin/python}}
FLASHINFER=${FLASHINFER:-flashinfer-python==0.7.2.post1}
NIXL=${NIXL:-nixl-cu13==1.5.1}
# pydantic (the router's policy, which the prefill batch imports: tests/engine/test_sampling_controls.py)
# at the versions this venv resolved, so that pydantic and its compiled core match
PYD=$("$PY" -c "from importlib.metadata import version as v; print(' '.join(f'{n}=={v(n)}' for n in ('pydantic', 'pydantic_core', 'typing_inspection', 'annotated_types')))")
SMALL=${SMALL:-"apache-tvm-ffi==0.1.15.post2 mistral-common pytest-asyncio py-spy $PYD"}
dl() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 -d "$1" "${@:2}"
}
rm -rf .gpu && mkdir -p .gpu
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "gpu-bundle: pdserve wheel"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .gpu . 
echo "gpu-bundle: $SMALL"
# shellcheck disable=SC2086
dl .gpu $SMALL
echo "gpu-bundle: $FLASHINFER (kernel sources only where the attention kernels include them)"
dl "$tmp/fi" "$FLASHINFER"
mkdir -p "$tmp/fi/x" && (cd "$tmp/fi/x" && unzip -q ../*.whl)
find "$tmp/fi/x/flashinfer/data/csrc" -mindepth 1 -maxdepth 1 -type d -printf 'flashinfer/data/csrc/%f\n' > "$tmp/fi/skip"
(cd "$tmp/fi/x" && tar -cJf "$OLDPWD/.gpu/flashinfer.tar.xz" --exclude-from="$tmp/fi/skip" .)
echo "gpu-bundle: $NIXL (without nixl_ep)"
dl "$tmp/nx" "$NIXL"
mkdir -p "$tmp/nx/x" && (cd "$tmp/nx/x" && unzip -q ../*.whl && rm -rf nixl_ep_*)
(cd "$tmp/nx/x" && tar -cJf "$OLDPWD/.gpu/nixl.tar.xz" .)
du -ch .gpu/* | sed 's/^/gpu-bundle: /'
