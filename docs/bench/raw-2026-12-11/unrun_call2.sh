# Written in session 31 for the deep 8-warp build (ec19f1e and after; old = f9c4014), not run there (no device lent). Copy to
# .device/call2.sh and run as `C=<packed commit> bash .device/call2.sh`, with f9c4014's bench_looped as .device/bench_looped_old.xz:
# the full device suite (the deep build and the ring's move to attention_ring.rs have not run); CB W 6 / 8 new vs old alternated
# twice; CB W 16 at prompt 128 and 2048 with PONDER_SIMT_DEEP 1 / 2 (2: the deep build at two blocks an SM) alternated; depth
# batching W 64 with --overlap off / on, shared and last-exited K/V (the standing's depth-batching rows ran with overlap off).
set -u
: "${C:?set C to the commit tools/device/pack.sh printed}"
source tools/device/call.sh "$0"
tests 230
save
run warm_old 150 .device/bench_looped_old --suite cb --widths 8 --new-tokens 8
for i in 1 2; do
  C=f9c4014 bench cb68_old_$i 60 .device/bench_looped_old --suite cb --widths 6,8 --new-tokens 256
  bench cb68_new_$i 60 .device/bench_looped --suite cb --widths 6,8 --new-tokens 256
done
save
for i in 1 2; do
  for d in 1 2; do
    bench cb16_deep${d}_$i 40 env PONDER_SIMT_DEEP=$d .device/bench_looped --suite cb --widths 16 --new-tokens 256
  done
done
for i in 1 2; do
  for d in 1 2; do
    bench cb2k_deep${d}_$i 50 env PONDER_SIMT_DEEP=$d .device/bench_looped --suite cb --widths 16 --prompt-len 2048 --new-tokens 256
  done
done
save
for i in 1 2; do
  for o in off on; do
    bench cdb_shared_${o}_$i 40 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout shared --overlap $o --time-device
  done
done
for o in off on; do
  bench cdb_last_${o} 40 .device/bench_looped --suite cdb --widths 64 --mean-depths 2.5 --modes cb,cdb-refill --layout last-exited --overlap $o --time-device
done
save
cat "$S"
