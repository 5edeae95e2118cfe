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
//
// quantize_rows_*: the activations of a W8A8 GEMM (prefill, denoising), one E4M3 scale per row
// ("per-token dynamic" scales), for cuBLASLt's FP8 matmul. One block a row: the row's largest
// magnitude m, its scale s = m · f32(1/448) (1 for an all-zero row), each value x / s clamped to
// ±448 and rounded to the nearest E4M3, ties to even. Bit for bit what Fp8Weight::quantize
// computes on the CPU: candle divides by a scalar as a multiply by its f32 reciprocal, and
// divides tensors with a true division.
//
// e4m3_to_*, e4m3_from_f32: the casts between E4M3 and the float dtypes (candle 0.11's own CUDA
// casts for F8E4M3 are looked up under names its PTX does not have). e4m3_to_* optionally
// multiplies each row of k values by its f32 scale before rounding to T: the dequantization,
// T(e4m3 · scale) in f32, as the CPU reference computes it. e4m3_from_f32 rounds to the
// nearest E4M3, ties to even, saturating at ±448 (the callers clamp first, as the CPU does).

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

// The largest of every thread's `v` in the block (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ float block_max(float v) {
    __shared__ float part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
        if (threadIdx.x == 0) part[0] = v;
    }
    __syncthreads();
    return part[0];
}

template <typename T> __device__ void quantize_rows(uint8_t *q, float *scale, const T *x, int k) {
    const long long row = blockIdx.x;
    const T *xr = x + row * k;
    float m = 0.f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) m = fmaxf(m, fabsf(to_f(xr[i])));
    m = block_max(m);
    const float s = m == 0.f ? 1.f : m * (1.0f / 448.0f);
    uint8_t *qr = q + row * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        // Clamped as candle clamps (a comparison each way), which keeps a NaN a NaN.
        float v = __fdiv_rn(to_f(xr[i]), s);
        v = v < -448.f ? -448.f : v;
        v = v > 448.f ? 448.f : v;
        qr[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
    }
    if (threadIdx.x == 0) scale[row] = s;
}

template <typename T>
__device__ void e4m3_to(T *out, const uint8_t *q, const float *scale, long long k, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = e4m3_to_f(q[i]);
        out[i] = from_f<T>(scale != nullptr ? v * scale[i / k] : v);
    }
}

} // namespace

extern "C" __global__ void e4m3_from_f32(uint8_t *out, const float *x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3));
}

#define FP8_KERNELS(T, SUF)                                                                                  \
    extern "C" __global__ void fp8_linear_##SUF(T *out, const T *x, const uint8_t *w, const float *scale,   \
                                                const T *bias, int rows, int n, int k) {                     \
        fp8_linear<T>(out, x, w, scale, bias, rows, n, k);                                                   \
    }                                                                                                        \
    extern "C" __global__ void quantize_rows_##SUF(uint8_t *q, float *scale, const T *x, int k) {            \
        quantize_rows<T>(q, scale, x, k);                                                                    \
    }                                                                                                        \
    extern "C" __global__ void e4m3_to_##SUF(T *out, const uint8_t *q, const float *scale, long long k,      \
                                             long long n) {                                                  \
        e4m3_to<T>(out, q, scale, k, n);                                                                     \
    }

FP8_KERNELS(float, f32)
FP8_KERNELS(__nv_bfloat16, bf16)
FP8_KERNELS(__half, f16)
