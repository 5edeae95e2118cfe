# Written in session 32 (no device lent), not yet run. Copy to .device/call3.sh and run as
# `bash .device/call3.sh` (carry .device; no binaries needed: the probe is built by the device's nvcc).
# tools/ring_probe.cu with the norms folded into the projections (tools/probe_norms.cuh) against
# the library's chain (cuBLAS + the library's norm and SiLU·mul kernels, tools/probe_cublas_chain.cuh),
# at 16 rows (with and without the library's decode attention, tools/probe_attention.cuh) and at 64
# rows (-DPROBE_ROWS=64, without attention): the correctness checks (mode 0, exit 2 past their
# tolerances), `compare` (graphs of a step's chain, each checked over the whole step first, alternated
# three rounds), the fused cases alone, then compute-sanitizer synccheck / memcheck of the fused
# launches. Ordered by what matters most; the steps' limits sum to the call's 600 s.
set -u
mkdir -p "$OUT/r"
cp "$0" "$OUT/r/call.sh"
S=$OUT/r/summary.txt
start=$(date +%s)
t() { echo "t=$(( $(date +%s) - start ))s"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv >> "$S" 2>&1
# cuBLAS: the toolkit's, else the pip wheel PyTorch uses (headers optional: the probe declares what it calls).
roots="/usr/local/cuda/ /usr/local /usr/lib /opt $(python3 -c 'import site; print(" ".join(site.getsitepackages()))')"
lib=$(find $roots -name 'libcublas.so*' -not -path '*/stubs/*' 2>/dev/null | head -1)
inc=$(dirname "$(find $roots -name cublas_v2.h 2>/dev/null | head -1)")
echo "cuBLAS: $lib (headers: $inc)" >> "$S"
libdir=$(dirname "$lib")
# ≈ 55 s each on the development machine (probe_attention.cuh includes all of paged_attention.cu): both at once.
build() { timeout 170 nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -Itools ${inc:+-I$inc} "$@" tools/ring_probe.cu -L"$libdir" -l:"$(basename "$lib")" -Xlinker -rpath="$libdir"; }
build -o /tmp/ring64 -DPROBE_ROWS=64 > "$OUT/r/nvcc64.log" 2>&1 &
b64=$!
build -o /tmp/ring >> "$S" 2>&1
echo "== nvcc rc $? $(t)" >> "$S"
wait $b64
rc64=$?
cat "$OUT/r/nvcc64.log" >> "$S"
echo "== nvcc 64 rows rc $rc64 $(t)" >> "$S"
export LD_LIBRARY_PATH=$libdir:${LD_LIBRARY_PATH:-}
timeout 40 /tmp/ring 0 >> "$S" 2>&1
echo "== checks rc $? $(t)" >> "$S"
for rep in 1 2; do
  timeout 50 /tmp/ring compare >> "$S" 2>&1
  echo "== compare $rep rc $? $(t)" >> "$S"
done
timeout 40 /tmp/ring64 0 >> "$S" 2>&1
echo "== checks 64 rows rc $? $(t)" >> "$S"
timeout 50 /tmp/ring64 compare >> "$S" 2>&1
echo "== compare 64 rows rc $? $(t)" >> "$S"
for i in 15 16; do
  timeout 15 /tmp/ring $i 2>&1 | grep -v "^SMs" >> "$S"
done
echo "== cases $(t)" >> "$S"
# Sanitizers last (16 phases each): synccheck and memcheck at 16 rows, synccheck at 64.
for tool in synccheck memcheck; do
  timeout 55 compute-sanitizer --tool $tool --print-limit 10 /tmp/ring sanitize > "$OUT/r/$tool.log" 2>&1
  echo "== $tool rc $? $(t)" >> "$S"
  tail -5 "$OUT/r/$tool.log" >> "$S"
done
timeout 55 compute-sanitizer --tool synccheck --print-limit 10 /tmp/ring64 sanitize > "$OUT/r/synccheck64.log" 2>&1
echo "== synccheck 64 rows rc $? $(t)" >> "$S"
tail -5 "$OUT/r/synccheck64.log" >> "$S"
cat "$S"
