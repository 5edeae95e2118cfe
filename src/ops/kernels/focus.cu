// FOCUS importance scores (ponder), batched over requests: for each row r, its m masked tokens
// (token indices gather[r*M + i], i < lens[r] <= M <= 32), every query head h and masked query
// i: s(i,j) = q_i^h . k_j^{h/group} * scale over the row's masked keys j; max-pool over j with
// window 3 along the masked list (missing neighbours = -inf); softmax over j; summed over heads
// and queries into I(j). Two passes: one block per (row, head) writes that head's column sums
// (queries summed in order), then one block per row sums the heads in order, so the result is
// deterministic. The total is rounded through T (the reference stores it in the model dtype).
// out[r*M + j] = 0 for j >= lens[r].

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define FOCUS_MAX_M 32
#define FOCUS_MAX_D 128

namespace {

__device__ __forceinline__ float f32_of(float x) { return x; }
__device__ __forceinline__ float f32_of(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float f32_of(__half x) { return __half2float(x); }
__device__ __forceinline__ float round_as(float x, const float *) { return x; }
__device__ __forceinline__ float round_as(float x, const __nv_bfloat16 *) { return __bfloat162float(__float2bfloat16(x)); }
__device__ __forceinline__ float round_as(float x, const __half *) { return __half2float(__float2half(x)); }

// Pass 1, grid (rows, heads): one head's contribution per key token, partial[(r*H + h)*M + j]
// = sum over masked queries i of softmax_j(maxpool3(s))(i, j). Keys are padded to 129 floats per
// row in shared memory so that a warp reading 32 keys at one d hits 32 banks.
template <typename T>
__device__ void focus_importance_heads(float *__restrict__ partial, const T *__restrict__ q, const T *__restrict__ k,
                                       const uint32_t *__restrict__ gather, const uint32_t *__restrict__ lens,
                                       int M, int heads, int kv_heads, int D, float scale) {
    __shared__ float qs[FOCUS_MAX_M][FOCUS_MAX_D + 1];
    __shared__ float ks[FOCUS_MAX_M][FOCUS_MAX_D + 1];
    __shared__ float w[FOCUS_MAX_M][FOCUS_MAX_M + 1];
    const int r = blockIdx.x, h = blockIdx.y;
    const int m = min((int)lens[r], M);
    const int tid = threadIdx.x;
    const int g = h / (heads / kv_heads);
    for (int e = tid; e < m * D; e += blockDim.x) {
        const int i = e / D, d = e - i * D;
        const long long t = gather[(long long)r * M + i];
        qs[i][d] = f32_of(q[(t * heads + h) * D + d]);
        ks[i][d] = f32_of(k[(t * kv_heads + g) * D + d]);
    }
    __syncthreads();
    for (int e = tid; e < m * m; e += blockDim.x) {
        const int i = e / m, j = e - i * m;
        float acc = 0.f;
        for (int d = 0; d < D; ++d) acc += qs[i][d] * ks[j][d];
        w[i][j] = acc * scale;
    }
    __syncthreads();
    if (tid < m) {
        // Row tid: pool (reading the raw scores of the row kept in registers), then softmax.
        const int i = tid;
        float raw[FOCUS_MAX_M];
        for (int j = 0; j < m; ++j) raw[j] = w[i][j];
        float mx = -INFINITY;
        for (int j = 0; j < m; ++j) {
            float p = raw[j];
            if (j > 0) p = fmaxf(p, raw[j - 1]);
            if (j + 1 < m) p = fmaxf(p, raw[j + 1]);
            w[i][j] = p;
            mx = fmaxf(mx, p);
        }
        float z = 0.f;
        for (int j = 0; j < m; ++j) {
            const float e = expf(w[i][j] - mx);
            w[i][j] = e;
            z += e;
        }
        const float inv = 1.f / z;
        for (int j = 0; j < m; ++j) w[i][j] *= inv;
    }
    __syncthreads();
    if (tid < M) {
        float colsum = 0.f;
        if (tid < m)
            for (int i = 0; i < m; ++i) colsum += w[i][tid];
        partial[((long long)r * heads + h) * M + tid] = colsum;
    }
}

// Pass 2, grid (rows), block >= M: I(j) = sum over heads in order, rounded through T.
template <typename T>
__device__ void focus_importance_sum(float *__restrict__ out, const float *__restrict__ partial,
                                     const uint32_t *__restrict__ lens, int M, int heads, const T *) {
    const int r = blockIdx.x, j = threadIdx.x;
    if (j >= M) return;
    const int m = min((int)lens[r], M);
    float acc = 0.f;
    for (int h = 0; h < heads; ++h) acc += partial[((long long)r * heads + h) * M + j];
    out[(long long)r * M + j] = j < m ? round_as(acc, (const T *)nullptr) : 0.f;
}

}  // namespace

#define FOCUS_OPS(T, SUF)                                                                          \
    extern "C" __global__ void focus_importance_heads_##SUF(                                       \
        float *partial, const T *q, const T *k, const uint32_t *gather, const uint32_t *lens, int M, \
        int heads, int kv_heads, int D, float scale) {                                             \
        focus_importance_heads<T>(partial, q, k, gather, lens, M, heads, kv_heads, D, scale);      \
    }                                                                                              \
    extern "C" __global__ void focus_importance_sum_##SUF(float *out, const float *partial,        \
                                                          const uint32_t *lens, int M, int heads) { \
        focus_importance_sum<T>(out, partial, lens, M, heads, (const T *)nullptr);                 \
    }

FOCUS_OPS(float, f32)
FOCUS_OPS(__nv_bfloat16, bf16)
FOCUS_OPS(__half, f16)
