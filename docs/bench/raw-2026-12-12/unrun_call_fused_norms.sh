# Written in session 32 (no device lent), not yet run. Copy to .device/call3.sh and run as
# `bash .device/call3.sh` (carry .device; no binaries needed: the probe is built by the device's nvcc).
# tools/ring_probe.cu with the norms folded into the projections (tools/probe_norms.cuh) against
# the library's chain (cuBLAS + the library's norm and SiLU·mul kernels, tools/probe_cublas_chain.cuh):
# the correctness checks (mode 0), `compare` (six graphs of a step's chain without attention and
# two with the library's decode attention, alternated three rounds), the fused cases alone, and synccheck / memcheck of the fused launches.
set -u
mkdir -p "$OUT/r"
cp "$0" "$OUT/r/call.sh"
S=$OUT/r/summary.txt
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> "$S" 2>&1
# cuBLAS: the toolkit's, else the pip wheel PyTorch uses (headers optional: the probe declares what it calls).
roots="/usr/local/cuda/ /usr/local /usr/lib /opt $(python3 -c 'import site; print(" ".join(site.getsitepackages()))')"
lib=$(find $roots -name 'libcublas.so*' -not -path '*/stubs/*' 2>/dev/null | head -1)
inc=$(dirname "$(find $roots -name cublas_v2.h 2>/dev/null | head -1)")
echo "cuBLAS: $lib (headers: $inc)" >> "$S"
libdir=$(dirname "$lib")
# ≈ 55 s on the development machine: probe_attention.cuh includes all of paged_attention.cu
timeout 180 nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -Itools ${inc:+-I$inc} tools/ring_probe.cu -o /tmp/ring -L"$libdir" -l:"$(basename "$lib")" -Xlinker -rpath="$libdir" >> "$S" 2>&1
echo "== nvcc rc $? t=$(( $(date +%s) - start ))s" >> "$S"
export LD_LIBRARY_PATH=$libdir:${LD_LIBRARY_PATH:-}
timeout 40 /tmp/ring 0 >> "$S" 2>&1
echo "== checks rc $? t=$(( $(date +%s) - start ))s" >> "$S"
for rep in 1 2; do
  timeout 60 /tmp/ring compare >> "$S" 2>&1
  echo "== compare $rep rc $? t=$(( $(date +%s) - start ))s" >> "$S"
done
for i in 4 15 16; do
  timeout 20 /tmp/ring $i 2>&1 | grep -v "^SMs" >> "$S"
done
echo "== cases t=$(( $(date +%s) - start ))s" >> "$S"
timeout 100 compute-sanitizer --tool synccheck --print-limit 10 /tmp/ring sanitize > "$OUT/r/synccheck.log" 2>&1
echo "== synccheck rc $? t=$(( $(date +%s) - start ))s" >> "$S"
tail -5 "$OUT/r/synccheck.log" >> "$S"
timeout 100 compute-sanitizer --tool memcheck --print-limit 10 /tmp/ring sanitize > "$OUT/r/memcheck.log" 2>&1
echo "== memcheck rc $? t=$(( $(date +%s) - start ))s" >> "$S"
tail -5 "$OUT/r/memcheck.log" >> "$S"
cat "$S"
