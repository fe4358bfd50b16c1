#!/usr/bin/env bash
# Prepare the GPU check (benchmarks/gpu_check.sh) for a machine with no network: download, here,
# the wheels of the Python packages the check needs besides what such a machine is assumed to
# hold, into the ignored folder .gpu-wheels/ that travels with the working tree.
#
# Assumed on the GPU machine (too large to travel, 64 MiB for the whole tree): a CUDA build of
# torch with its triton, numpy, transformers, accelerate, huggingface-hub, pandas, pyarrow,
# pytest, packaging, pyyaml, jinja2, psutil, requests, tqdm, filelock, fsspec. The check's first
# step prints the version of each, or MISSING, and records it in its log.
# Carried (pure Python, or small binary wheels for the GPU machine's CPython): echoloss's own
# pydantic (and its pydantic-core), the peers trl and liger-kernel, trl's datasets (with dill,
# multiprocess, xxhash), the tests' hypothesis.
#
#   bash benchmarks/gpu_prepare.sh                    # CPython 3.12 (the GPU image's python3) and 3.11
#   GPU_PYTHONS=3.12 bash benchmarks/gpu_prepare.sh   # one version only (a folder per version)
#
# Versions: the pins below (the ones this repository's tests run with; trl and liger-kernel as
# pyproject's extras pin them). Writes .gpu-wheels/cp3XX/*.whl and .gpu-wheels/MANIFEST (the
# commit prepared at, the versions, the sizes). Exit status: 0 when every wheel was downloaded.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${GPU_WHEELS_DIR:-.gpu-wheels}
PYTHONS=${GPU_PYTHONS:-3.12 3.11}
PINS=(
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  typing-extensions==4.16.0
  trl==1.16.0 liger-kernel==0.8.5
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
  hypothesis==6.155.2 sortedcontainers==2.4.0
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
status=0
rm -rf "$DEST"
mkdir -p "$DEST"
for ver in $PYTHONS; do
  tag=cp${ver/./}
  mkdir -p "$DEST/$tag"
  plat=()
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  for pin in "${PINS[@]}"; do
    if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$ver" \
      --implementation cp "${plat[@]}" -d "$DEST/$tag" "$pin"; then
      echo "gpu_prepare: no wheel of $pin for CPython $ver (linux x86_64)" >&2
      status=1
    fi
  done
done
{
  echo "prepared_at_commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "dirty $(git status --porcelain -- echoloss benchmarks tests 2>/dev/null | wc -l)"
  echo "pythons $PYTHONS"
  (cd "$DEST" && find . -name '*.whl' | sort)
  echo "bytes $(du -sb "$DEST" | cut -f1)"
} >"$DEST/MANIFEST"
cat "$DEST/MANIFEST"
size=$(du -sb "$DEST" | cut -f1)
if [ "$size" -gt $((24 * 1024 * 1024)) ]; then
  echo "gpu_prepare: $DEST is $size bytes; with the tree it must stay under 64 MiB" >&2
  status=1
fi
exit $status
