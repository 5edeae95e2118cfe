// Skinny GEMMs of the decode step (ponder): out = x · W^T for x of at most 64 rows, where the
// cost is streaming W once. The tile GEMM (tile_gemm.cuh, 64 x 128 x 64 tiles) runs over W's row
// tiles and, when those are too few to keep every SM streaming, over slices of K too: each slice
// writes f32 partial sums, which splitk_reduce adds in slice order (so a row's result does not
// depend on the other rows of the batch) and rounds once.
//
// linear_skinny_*: one slice, out T [rows, N].
// linear_skinny_splitk_*: grid z = slices of k_chunk columns, parts f32 [slices, rows, N].
// splitk_reduce_*: out = T(sum over slices of parts), four elements per thread.

#include "tile_gemm.cuh"

namespace {

template <typename T>
__device__ void splitk_reduce(T *__restrict__ out, const float *__restrict__ parts, int splits, long long n) {
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= n) return;
    float4 acc = *reinterpret_cast<const float4 *>(parts + i);
    for (int z = 1; z < splits; ++z) {
        const float4 p = *reinterpret_cast<const float4 *>(parts + (long long)z * n + i);
        acc.x += p.x;
        acc.y += p.y;
        acc.z += p.z;
        acc.w += p.w;
    }
    alignas(8) T o[4] = {from_f<T>(acc.x), from_f<T>(acc.y), from_f<T>(acc.z), from_f<T>(acc.w)};
    *reinterpret_cast<uint2 *>(out + i) = *reinterpret_cast<uint2 *>(o);
}

} // namespace

#define LINEAR_OPS(T, SUF)                                                                                     \
    extern "C" __global__ void linear_skinny_##SUF(T *out, const T *x, const T *w, int N, int K, int rows) {    \
        tile_gemm<T, T, 64, 32, PLAIN>(out, x, w, nullptr, nullptr, nullptr, nullptr, N, K, K, rows, K);      \
    }                                                                                                          \
    extern "C" __global__ void linear_skinny_splitk_##SUF(float *parts, const T *x, const T *w, int N, int K,  \
                                                          int rows, int k_chunk) {                            \
        tile_gemm<T, float, 64, 32, F32_OUT>(parts, x, w, nullptr, nullptr, nullptr, nullptr, N, K, K, rows,   \
                                             k_chunk);                                                        \
    }                                                                                                          \
    extern "C" __global__ void splitk_reduce_##SUF(T *out, const float *parts, int splits, long long n) {      \
        splitk_reduce<T>(out, parts, splits, n);                                                                \
    }

LINEAR_OPS(__nv_bfloat16, bf16)
LINEAR_OPS(__half, f16)
