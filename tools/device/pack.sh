#!/usr/bin/env bash
# Builds the CUDA binaries here and packs them for the device tool (carry [".device"]):
#
#     tools/device/pack.sh [bench_looped] [bench_diffusion] [bench_parallel] [gpu_kernels]
#                          [gpu_parallel] [bench_serve] [bench_serving]
#                                                          # default: bench_looped,
#                                                          # bench_diffusion, gpu_kernels
#
# Writes .device/NAME.xz (≈ 6.5 MB each; three fit the 64 MiB carry), .device/gpu-env.sh and
# .device/unpack.sh. On the device, in every call (unpacked binaries do not survive between
# calls): `source .device/unpack.sh && .device/bench_looped …`. Prints the commit to pass as
# --commit; refuses a dirty tree, so that commit is what the binaries were built from.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "pack.sh: commit first (tracked files changed); the binaries must match --commit" >&2
  exit 1
fi
# Cargo builds the working tree as it is while it builds: an edit or a commit during the build
# would go into binaries labelled with the commit read here. Checked again at the end.
packed=$(git rev-parse HEAD)
shared=../shared/cuda
[ -x "$(command -v nvcc || true)" ] || source "$shared/env.sh"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda}
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(bench_looped bench_diffusion gpu_kernels)
mkdir -p .device
rm -f .device/*.xz
for n in "${names[@]}"; do
  case "$n" in
    gpu_kernels | gpu_parallel)
      bin=$(cargo test --release --features cuda --test "$n" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$n" | tail -1) ;;
    bench_serve | bench_serving)
      cargo build --release --features cuda -p ponder-serve --example "$n" >&2
      bin=$CARGO_TARGET_DIR/release/examples/$n ;;
    bench_*)
      cargo build --release --features cuda --example "$n" >&2
      bin=$CARGO_TARGET_DIR/release/examples/$n ;;
    *) echo "pack.sh: unknown binary $n (bench_looped | bench_diffusion | bench_parallel | gpu_kernels | gpu_parallel | bench_serve | bench_serving)" >&2; exit 1 ;;
  esac
  [ -n "$bin" ] && [ -x "$bin" ] || { echo "pack.sh: no binary for $n" >&2; exit 1; }
  xz -9 -T2 -c "$bin" > ".device/$n.xz"
done
cp "$shared/gpu-env.sh" .device/gpu-env.sh
cat > .device/unpack.sh <<'UNPACK'
# Unpacks the carried binaries (Python's lzma: no xz on the device) and sets up the libraries.
for f in .device/*.xz; do
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[1][:-3],'wb'))" "$f"
  chmod +x "${f%.xz}"
done
source .device/gpu-env.sh
# NCCL (tensor parallelism over GPUs) is opened at run time: PyTorch's wheel ships it.
_nccl=$(python3 -c 'import nvidia, glob, os; print(next((os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/**/libnccl.so.2", recursive=True)), ""))' 2>/dev/null)
[ -n "$_nccl" ] && export LD_LIBRARY_PATH="$_nccl:$LD_LIBRARY_PATH"
unset _nccl
UNPACK
ls -l .device/*.xz >&2
if [ "$(git rev-parse HEAD)" != "$packed" ] || [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  rm -f .device/*.xz
  echo "pack.sh: the tree changed while building; the binaries are discarded, pack again" >&2
  exit 1
fi
git rev-parse --short HEAD
