// The tile GEMM our kernels share (ponder): out = A · W^T in bf16 / f16 on tensor cores, with
// the helpers around it. Included by moe.cu (grouped expert GEMMs, the router) and linear.cu
// (skinny decode GEMMs); each .cu is its own PTX module, so everything here is file-local.

#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }
template <typename T> __device__ __forceinline__ float round_t(float x) { return to_f(from_f<T>(x)); }

constexpr uint32_t NONE = 0xffffffffu;

constexpr int BN = 128, BK = 64, STAGES = 3, ROW_BYTES = BK * 2;

__device__ __forceinline__ void cp_async16(unsigned smem, const void *gmem, bool valid) {
    const int bytes = valid ? 16 : 0; // 0: the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

template <typename T> __device__ __forceinline__ void mma16816(float *c, const uint32_t *a, const uint32_t *b);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma16816<__half>(float *c, const uint32_t *a, const uint32_t *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Byte offset of 16-byte chunk `c` (of 8) of row `r` in a tile of 128-byte rows: chunks are
// XOR-swizzled by row so that the same chunk of eight consecutive rows falls in distinct banks.
__device__ __forceinline__ unsigned tile_offset(int r, int c) { return r * ROW_BYTES + ((c ^ (r & 7)) << 4); }

enum Epilogue { SWIGLU, PLAIN, F32_OUT };

// out[r] = A[src(r)] · W[e]^T over the rows r of each tile. grid (tiles, ceil(N / BN), splits);
// block
// BM / 64 * BN / WTN warps, each a 64 x WTN warp tile of m16n8k16 MMAs. Tiles come from moe_offsets
// (`tile_expert` / `tile_start` / `expert_end`), or, with `tile_expert` null, cut one matrix of
// `dense_rows` rows (expert 0). `src` maps a sorted row to its row of A (null: the row itself);
// column k of the K columns reads A's column k % a_cols (a_cols = K, or K / 3 for the router's
// three-way split weights). Split z of blockIdx.z covers columns [z * k_chunk, (z + 1) * k_chunk)
// of K (k_chunk a multiple of 64) and writes its own out[z] (each [rows, N]): F32_OUT partial
// sums that a reduction adds in order. K and a_cols multiples of 8 (of 64 for the router's
// a_cols < K); N a multiple of 32 for SWIGLU, else of 8.
template <typename T, typename O, int BM, int WTN, Epilogue EPI>
__device__ void tile_gemm(O *__restrict__ out, const T *__restrict__ A, const T *__restrict__ W,
                         const uint32_t *__restrict__ src, const uint32_t *__restrict__ tile_expert,
                         const uint32_t *__restrict__ tile_start, const uint32_t *__restrict__ expert_end, int N,
                         int K, int a_cols, int dense_rows, int k_chunk) {
    constexpr int WM = BM / 64, WN = BN / WTN, THREADS = WM * WN * 32, NT = WTN / 8; // NT n8 tiles per warp
    constexpr int A_PER = BM * 8 / THREADS, B_PER = BN * 8 / THREADS; // 16-byte chunks per thread
    constexpr int A_BYTES = BM * ROW_BYTES, STAGE_BYTES = (BM + BN) * ROW_BYTES;
    uint32_t e = 0;
    int row0, rows;
    if (tile_expert) {
        e = tile_expert[blockIdx.x];
        if (e == NONE) return;
        row0 = (int)tile_start[blockIdx.x];
        rows = min(BM, (int)expert_end[e] - row0);
    } else {
        row0 = blockIdx.x * BM;
        rows = min(BM, dense_rows - row0);
    }
    const int n0 = blockIdx.y * BN;
    const T *We = W + (size_t)e * N * K;
    const int k_begin = blockIdx.z * k_chunk, k_end = min(K, k_begin + k_chunk);
    out += (size_t)blockIdx.z * (tile_expert ? 0 : dense_rows) * (EPI == SWIGLU ? N / 2 : N);

    extern __shared__ __align__(128) unsigned char gemm_smem[];
    const unsigned smem = (unsigned)__cvta_generic_to_shared(gemm_smem);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / WN, wn = warp % WN;
    // Every chunk this thread loads is chunk tid % 8 of its row (THREADS is a multiple of 8).
    const int kc = tid & 7;

    const T *a_src[A_PER];
    bool a_ok[A_PER];
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
        const int r = tid / 8 + i * (THREADS / 8);
        a_ok[i] = r < rows;
        const int sorted = row0 + (a_ok[i] ? r : 0);
        const uint32_t s = src ? src[sorted] : (uint32_t)sorted;
        a_src[i] = A + (size_t)s * a_cols + kc * 8;
    }
    const T *b_src = We + (size_t)(n0 + tid / 8) * K + kc * 8;
    auto load = [&](int stage, int k0) {
        const unsigned base = smem + stage * STAGE_BYTES;
        const bool k_ok = k0 + kc * 8 < k_end;
        const int ka = k0 % a_cols;
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const bool ok = a_ok[i] && k_ok;
            cp_async16(base + tile_offset(tid / 8 + i * (THREADS / 8), kc), ok ? a_src[i] + ka : A, ok);
        }
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            const int r = tid / 8 + i * (THREADS / 8);
            const bool ok = n0 + r < N && k_ok;
            cp_async16(base + A_BYTES + tile_offset(r, kc), ok ? b_src + (size_t)i * (THREADS / 8) * K + k0 : W, ok);
        }
    };

    float acc[4][NT][4]; // [m16 tile][n8 tile][fragment]
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

    const int KT = (k_end - k_begin + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load(s, k_begin + s * BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        // Refill the stage every warp finished reading in the previous iteration.
        if (kt + STAGES - 1 < KT) load((kt + STAGES - 1) % STAGES, k_begin + (kt + STAGES - 1) * BK);
        cp_async_commit();
        const unsigned a_base = smem + (kt % STAGES) * STAGE_BYTES, b_base = a_base + A_BYTES;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            uint32_t a[4][4], b[NT][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = wm * 64 + i * 16 + (lane & 15);
                ldmatrix_x4(a_base + tile_offset(r, kk * 2 + (lane >> 4)), a[i][0], a[i][1], a[i][2], a[i][3]);
            }
#pragma unroll
            for (int p = 0; p < NT / 2; ++p) {
                const int r = wn * WTN + p * 16 + (lane & 7) + ((lane >> 4) << 3);
                ldmatrix_x4(b_base + tile_offset(r, kk * 2 + ((lane >> 3) & 1)), b[2 * p][0], b[2 * p][1], b[2 * p + 1][0],
                            b[2 * p + 1][1]);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < NT; ++j) mma16816<T>(acc[i][j], a[i], b[j]);
        }
    }
    cp_async_wait<0>();

    // Epilogue from registers: fragment v of n8 tile j holds row lane / 4 (+ 8 for v >= 2),
    // columns 2 * (lane % 4) + (v & 1) of the tile.
    const int out_w = EPI == SWIGLU ? N / 2 : N;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * 64 + i * 16 + (lane >> 2) + h * 8;
            if (r >= rows) continue;
            O *orow = out + (size_t)(row0 + r) * out_w;
            if constexpr (EPI == SWIGLU) {
                // Each 32 columns of the warp are one chunk pair: n8 tiles 0-1 gate, 2-3 the
                // matching up.
#pragma unroll
                for (int q = 0; q < WTN / 32; ++q) {
                    const int pair = (n0 + wn * WTN + q * 32) / 32;
                    if (pair * 32 >= N) continue;
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        float o[2];
#pragma unroll
                        for (int v = 0; v < 2; ++v) {
                            const float g = round_t<T>(acc[i][q * 4 + j][h * 2 + v]);
                            const float u = round_t<T>(acc[i][q * 4 + j + 2][h * 2 + v]);
                            o[v] = round_t<T>(g / (1.f + expf(-g))) * u;
                        }
                        const int col = pair * 16 + j * 8 + (lane & 3) * 2;
                        T pr[2] = {from_f<T>(o[0]), from_f<T>(o[1])};
                        *reinterpret_cast<uint32_t *>(orow + col) = *reinterpret_cast<uint32_t *>(pr);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int col = n0 + wn * WTN + j * 8 + (lane & 3) * 2;
                    if (col >= N) continue;
                    if constexpr (EPI == F32_OUT) {
                        *reinterpret_cast<float2 *>(orow + col) = make_float2(acc[i][j][h * 2], acc[i][j][h * 2 + 1]);
                    } else {
                        T pr[2] = {from_f<T>(acc[i][j][h * 2]), from_f<T>(acc[i][j][h * 2 + 1])};
                        *reinterpret_cast<uint32_t *>(orow + col) = *reinterpret_cast<uint32_t *>(pr);
                    }
                }
            }
        }
}

} // namespace
