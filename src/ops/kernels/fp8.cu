// Weight-only FP8 linear layers at decode widths (ponder): y = x · Wᵀ (+ b) for x [M, K] in T
// (M ≤ FP8_MAX_ROWS) and W [N, K] in E4M3 with one f32 scale per output row. Each weight is
// dequantized as the reference dequantizes it, T(e4m3 · scale), and the products are summed in
// f32; the output is rounded to T and the bias added after that rounding (candle's Linear:
// matmul, then the broadcast add). At these widths the layer is memory-bound and reads a byte a
// weight, half of bf16's.
//
// fp8_linear_*: one warp per output row (8 rows a block); each lane takes 16 weights at a time,
// one 16-byte load, and applies them to every row of x (x is small and stays in L1 / L2).
// K must be a multiple of 16, x's rows and W's 16-byte aligned (checked by the launcher).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#define FP8_MAX_ROWS 16

#include "floats.cuh"

namespace {

__device__ __forceinline__ float e4m3_to_f(uint8_t b) {
    __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
    return __half2float(__half(h));
}

// 16 consecutive elements of x as floats, in 16-byte loads.
template <typename T> __device__ __forceinline__ void load16(const T *p, float *v) {
    constexpr int PER = 16 / sizeof(T); // elements a load
#pragma unroll
    for (int i = 0; i < 16 / PER; ++i) {
        uint4 raw = reinterpret_cast<const uint4 *>(p)[i];
        const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
        for (int j = 0; j < PER; ++j) v[i * PER + j] = to_f(e[j]);
    }
}

template <typename T>
__device__ void fp8_linear(T *out, const T *x, const uint8_t *w, const float *scale, const T *bias, int rows, int n,
                           int k) {
    const int lane = threadIdx.x % 32;
    const int col = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (col >= n) return;
    const float s = scale[col];
    float acc[FP8_MAX_ROWS];
#pragma unroll
    for (int m = 0; m < FP8_MAX_ROWS; ++m) acc[m] = 0.f;
    const uint8_t *wr = w + (long long)col * k;
    for (int k0 = lane * 16; k0 < k; k0 += 32 * 16) {
        uint4 packed = *reinterpret_cast<const uint4 *>(wr + k0);
        const uint8_t *bytes = reinterpret_cast<const uint8_t *>(&packed);
        float wv[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) wv[j] = round_t<T>(e4m3_to_f(bytes[j]) * s);
#pragma unroll
        for (int m = 0; m < FP8_MAX_ROWS; ++m) {
            if (m < rows) {
                float xv[16];
                load16(x + (long long)m * k + k0, xv);
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < 16; ++j) sum = fmaf(xv[j], wv[j], sum);
                acc[m] += sum;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < FP8_MAX_ROWS; ++m) {
        if (m < rows) {
            const float v = warp_sum(acc[m]);
            if (lane == 0) {
                float y = round_t<T>(v);
                if (bias != nullptr) y += to_f(bias[col]);
                out[(long long)m * n + col] = from_f<T>(y);
            }
        }
    }
}

} // namespace

#define FP8_KERNELS(T, SUF)                                                                                  \
    extern "C" __global__ void fp8_linear_##SUF(T *out, const T *x, const uint8_t *w, const float *scale,   \
                                                const T *bias, int rows, int n, int k) {                     \
        fp8_linear<T>(out, x, w, scale, bias, rows, n, k);                                                   \
    }

FP8_KERNELS(float, f32)
FP8_KERNELS(__nv_bfloat16, bf16)
FP8_KERNELS(__half, f16)
