// The library's decode layer chain (16 or 64 rows) for the probes to race: cuBLAS
// projections as the library calls them (QKV and gate/up whole into bf16, o_proj and down as four
// f32 partial products over k, `ops::split_k`) and the library's own row-norm and SiLU·mul kernels
// from src/ops/kernels/fused.cu (`add_rms_norm_parts_bf16`, `silu_mul_bf16`) with the library's
// launch shapes; o_proj reads QKV's first H columns in place of attention's output.
// Link with -lcublas.
#pragma once
#include "probe_norms.cuh"
#include "probe_attention.cuh"
#include "../src/ops/kernels/fused.cu"

#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#else
// The build machine's CUDA shim ships no cuBLAS headers: the few entry points used, as cublas_v2.h
// declares them (the device's toolkit has the header, and it is used there).
#include <library_types.h>
typedef struct cublasContext *cublasHandle_t;
typedef int cublasStatus_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99 } cublasGemmAlgo_t;
extern "C" {
cublasStatus_t cublasCreate_v2(cublasHandle_t *handle);
cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void *workspace, size_t bytes);
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k, const void *alpha, const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C, cudaDataType Ctype, int ldc, cublasComputeType_t computeType, cublasGemmAlgo_t algo);
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k, const void *alpha, const void *A, cudaDataType Atype, int lda,
                                          long long strideA, const void *B, cudaDataType Btype, int ldb, long long strideB, const void *beta, void *C, cudaDataType Ctype, int ldc, long long strideC,
                                          int batchCount, cublasComputeType_t computeType, cublasGemmAlgo_t algo);
}
#endif

#define CKB(x) do { int s_ = (int)(x); if (s_ != 0) { printf("%s:%d cuBLAS status %d\n", __FILE__, __LINE__, s_); exit(1); } } while (0)

constexpr int SPLITS = 4;  // the library's k slices for o_proj and down at 16 and 64 rows on the H200

__global__ void f32_to_bf16(const float *x, __nv_bfloat16 *y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = __float2bfloat16(x[i]);
}

// Sum of the down projection's partial products [SPLITS, ROWS, H] in slice order, f32.
__global__ void sum_parts(const float *parts, float *out) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < ROWS * H; i += gridDim.x * blockDim.x) {
        float v = 0.f;
        for (int s = 0; s < SPLITS; ++s) v += parts[(size_t)s * ROWS * H + i];
        out[i] = v;
    }
}

struct CublasChain {
    cublasHandle_t blas;
    cudaStream_t st;
    const __nv_bfloat16 *const (*plain)[L];  // plain[kind][layer], [n, k] row-major
    const Norms *nm;                          // its norm weights (bf16, as the probe's)
    const DecodeAttention *attention;  // between QKV and o_proj, where `application` asks for it
    __nv_bfloat16 *a, *qkv, *attn, *m, *gu, *act, *res[2];
    float *parts;

    CublasChain(cudaStream_t stream, const __nv_bfloat16 *const (*plain_)[L], const Norms *norms, const DecodeAttention *attn_) : st(stream), plain(plain_), nm(norms), attention(attn_) {
        CKB(cublasCreate_v2(&blas));
        CKB(cublasSetStream_v2(blas, st));
        void *ws;
        const size_t ws_bytes = 32u << 20;  // a workspace of its own, so capture allocates nothing
        CK(cudaMalloc(&ws, ws_bytes));
        CKB(cublasSetWorkspace_v2(blas, ws, ws_bytes));
        auto bf = [&](size_t n) {
            __nv_bfloat16 *p;
            CK(cudaMalloc(&p, n * 2));
            CK(cudaMemsetAsync(p, 0, n * 2, st));  // st does not wait on the legacy stream (non-blocking)
            return p;
        };
        a = bf((size_t)ROWS * H), qkv = bf((size_t)ROWS * 3 * H), attn = bf((size_t)ROWS * H), m = bf((size_t)ROWS * H), gu = bf((size_t)ROWS * 2 * I), act = bf((size_t)ROWS * I);
        res[0] = bf((size_t)ROWS * H), res[1] = bf((size_t)ROWS * H);
        CK(cudaMalloc(&parts, (size_t)SPLITS * ROWS * H * 4));
        CK(cudaStreamSynchronize(st));
    }

    // out [ROWS, n] (bf16) = x [ROWS, k] (leading dim ldx) · W[kind][l]ᵀ, as candle's matmul calls it
    // (candle-core's gemm_config / gemm_strided_batched_bf16: a strided batch of one, strides
    // n·k, rows·k, rows·n).
    void gemm(int kind, int l, const __nv_bfloat16 *x, int ldx, __nv_bfloat16 *out) const {
        const PhaseShape s = shape_of(kind);
        const float alpha = 1.f, beta = 0.f;
        CKB(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, s.n, ROWS, s.k, &alpha, plain[kind][l], CUDA_R_16BF, s.k, (long long)s.n * s.k, x, CUDA_R_16BF, ldx,
                                       (long long)ROWS * s.k, &beta, out, CUDA_R_16BF, s.n, (long long)ROWS * s.n, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP));
    }

    // parts[s] (f32 [ROWS, n]) = x[:, s kc..] · W[:, s kc..]ᵀ, as `ops::cuda::linear_partials` calls it.
    void partials(int kind, int l, const __nv_bfloat16 *x, int ldx) const {
        const PhaseShape s = shape_of(kind);
        const int kc = s.k / SPLITS;
        const float alpha = 1.f, beta = 0.f;
        CKB(cublasGemmStridedBatchedEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, s.n, ROWS, kc, &alpha, plain[kind][l], CUDA_R_16BF, s.k, kc, x, CUDA_R_16BF, ldx, kc, &beta, parts, CUDA_R_32F, s.n,
                                       (long long)ROWS * s.n, SPLITS, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP));
    }

    // One layer application from a (the normed input) and res[0] (the residual); with `norms`
    // false only the projections run (their inputs then stale: timing only); with `attend`, the
    // library's decode attention between QKV and o_proj, which then reads its output.
    void application(int app, bool norms, bool attend = false) const {
        const int l = app % L, next = (app + 1) % L;
        const int norm_threads = 256;  // `row_norm_config` at 2048 columns
        const int silu_blocks = (ROWS * I / 8 + 255) / 256;  // `silu_mul`'s grid at 16-byte vectors
        gemm(0, l, a, H, qkv);
        if (attend) attention->launch(l, qkv, attn);
        if (attend) partials(1, l, attn, H);
        else partials(1, l, qkv, 3 * H);
        if (norms) add_rms_norm_parts_bf16<<<ROWS, norm_threads, 0, st>>>(res[1], m, res[0], parts, (long long)ROWS * H, SPLITS, nm->w[l][0], nm->w[l][1], H, EPS);
        gemm(2, l, m, H, gu);
        if (norms) silu_mul_bf16<<<silu_blocks, 256, 0, st>>>(act, gu, ROWS, I);
        partials(3, l, act, I);
        if (norms) add_rms_norm_parts_bf16<<<ROWS, norm_threads, 0, st>>>(res[0], a, res[1], parts, (long long)ROWS * H, SPLITS, nm->w[l][2], nm->w[next][3], H, EPS);
        CK(cudaGetLastError());
    }

    // a = res[0] = bf16(x0), the probes' first input and residual.
    void start(const float *x0) const {
        f32_to_bf16<<<64, 256, 0, st>>>(x0, a, ROWS * H);
        f32_to_bf16<<<64, 256, 0, st>>>(x0, res[0], ROWS * H);
    }

    cudaGraphExec_t capture(bool norms, bool attend = false) const {
        cudaGraph_t g;
        cudaGraphExec_t ex;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        for (int app = 0; app < PHASES / 4; ++app) application(app, norms, attend);
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&ex, g, 0));
        return ex;
    }
};
