// mbarrier and bulk-copy helpers (sm_90 instructions) shared by the kernels that hand
// shared-memory stages between warps: the MoE GEMMs (moe.cu) and decode attention's ring
// (paged_attention.cu). Operands are shared-memory addresses (__cvta_generic_to_shared).
#pragma once
#include <stdint.h>

namespace {

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of parity `parity` has completed. Sound only if the waiter saw the
// barrier's previous phase complete itself: a waiter two phases behind passes on a stale one.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
}
// `bytes` (a multiple of 16, 16-byte aligned ends) global -> shared at `dst`, completing its bytes
// on `bar` (complete_tx).
__device__ __forceinline__ void bulk_copy_g2s(unsigned dst, const void *src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

}  // namespace
