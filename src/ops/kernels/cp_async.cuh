// Ampere's asynchronous copies, global to shared, 16 bytes a thread (ponder): the MoE GEMMs'
// tile loaders and the pipelined weight-only FP8 kernel share them. A copy lands in shared
// memory without passing through registers; `cp_async_wait<N>` returns once at most the N most
// recently committed groups of this thread are still in flight, its copies then visible to it.
#pragma once

namespace {

// `valid` false: the 16 bytes are zero-filled and `gmem` is not read (it must still be a
// device address).
__device__ __forceinline__ void cp_async16(unsigned smem, const void *gmem, bool valid) {
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// A compiler barrier too ("memory"): shared-memory reads after it must not be moved above it,
// where no __syncthreads() follows (a lane reading back its own copies).
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

} // namespace
