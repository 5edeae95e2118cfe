// Mixture-of-experts layers on the device (ponder): routing, grouping by expert, two grouped
// GEMMs on tensor cores, and the weighted combine. The reference is the CPU composition in
// src/models/diffusion/moe.rs; every value it rounds to the storage dtype is rounded here at the
// same place.
//
// moe_route: one warp per token over the f32 router logits [T, E]: scores (sigmoid or softmax),
//   the selection-only bias, the group limit (groups ranked by the sum of their two best biased
//   scores, ties to the lower index), top-k by biased score (ties to the lower index), weights =
//   unbiased scores, optionally divided by their sum, times a scale. Writes ids [T, K] u32 and
//   weights [T, K] f32.
// moe_align: one block. Counts the (token, k) pairs per expert, lays them out expert by expert
//   (sorted position of each pair, the source row token = pair / K of each sorted position) and
//   cuts every expert's rows into tiles of BM rows for the GEMMs (unused tile slots: expert ~0).
// moe_gemm_*: out[r] = A[src(r)] · W[e]^T for the rows r of each tile, W [E, N, K] row-major.
//   bf16/f16 WMMA 16x16x16 with f32 accumulators, tiles BM x 128 x 32, two cp.async stages,
//   warp tiles 32 x 64. The SwiGLU variant takes gate and up rows interleaved in chunks of 16
//   (chunk 2c = gate rows 16c.., chunk 2c+1 = up rows 16c..) and writes T(T(silu(gate)) * up)
//   [rows, N/2]; the plain variant writes T(acc) [rows, N].
// moe_combine_*: out[t] = T(sum_k w[t,k] * y[pos(t,k)] (+ shared[t])), f32 sums in k order.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>

namespace {

using namespace nvcuda;

__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }
template <typename T> __device__ __forceinline__ float round_t(float x) { return to_f(from_f<T>(x)); }

constexpr uint32_t NONE = 0xffffffffu;

// The better of two (value, index) candidates: larger value, then lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ __forceinline__ void warp_argmax(float &v, int &i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

// Dynamic shared memory: per warp, 2 * E floats (scores, biased choice scores) + G floats.
__device__ void route_tokens(uint32_t *__restrict__ ids, float *__restrict__ weights, const float *__restrict__ logits,
                          const float *__restrict__ bias, int tokens, int E, int K, int G, int KG, int softmax,
                          int norm_topk, float scale) {
    extern __shared__ float route_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= tokens) return;
    float *score = route_smem + (size_t)warp * (2 * E + G);
    float *choice = score + E;
    float *group = choice + E;
    const float *z = logits + (size_t)t * E;
    if (softmax) {
        float m = -INFINITY;
        for (int e = lane; e < E; e += 32) m = fmaxf(m, z[e]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        // The total is summed in expert order, as the reference does.
        for (int e = lane; e < E; e += 32) score[e] = expf(z[e] - m);
        __syncwarp();
        float total = 0.f;
        if (lane == 0)
            for (int e = 0; e < E; ++e) total += score[e];
        total = __shfl_sync(0xffffffffu, total, 0);
        for (int e = lane; e < E; e += 32) score[e] = score[e] / total;
    } else {
        for (int e = lane; e < E; e += 32) score[e] = 1.f / (1.f + expf(-z[e]));
    }
    for (int e = lane; e < E; e += 32) choice[e] = bias ? score[e] + bias[e] : score[e];
    __syncwarp();
    if (G > 1) {
        const int per = E / G;
        for (int g = lane; g < G; g += 32) {
            float a = -INFINITY, b = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; ++e) {
                const float v = choice[e];
                if (v > a) {
                    b = a;
                    a = v;
                } else if (v > b) {
                    b = v;
                }
            }
            group[g] = a + b;
        }
        __syncwarp();
        // Keep the KG best groups; the others' experts cannot be chosen.
        for (int r = 0; r < KG; ++r) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for (int g = lane; g < G; g += 32)
                if (!isnan(group[g]) && better(group[g], g, bv, bi)) {
                    bv = group[g];
                    bi = g;
                }
            warp_argmax(bv, bi);
            if (lane == 0) group[bi] = NAN; // NaN marks a kept group
            __syncwarp();
        }
        for (int e = lane; e < E; e += 32)
            if (!isnan(group[e / per])) choice[e] = NAN;
        __syncwarp();
    }
    // Top-k by biased score; NaN marks experts not choosable (excluded groups, already chosen).
    float total = 0.f;
    for (int k = 0; k < K; ++k) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int e = lane; e < E; e += 32)
            if (!isnan(choice[e]) && better(choice[e], e, bv, bi)) {
                bv = choice[e];
                bi = e;
            }
        warp_argmax(bv, bi);
        if (lane == 0) {
            ids[(size_t)t * K + k] = (uint32_t)bi;
            weights[(size_t)t * K + k] = score[bi];
            total += score[bi];
            choice[bi] = NAN;
        }
        __syncwarp();
    }
    if (lane == 0) {
        const float norm = norm_topk ? total + 1e-20f : 1.f;
        for (int k = 0; k < K; ++k) weights[(size_t)t * K + k] = weights[(size_t)t * K + k] / norm * scale;
    }
}

// One block; dynamic shared memory: 2 * E u32 (counts, then cursors).
__device__ void align_pairs(uint32_t *__restrict__ sorted_src, uint32_t *__restrict__ pos_of_pair,
                          uint32_t *__restrict__ expert_end, uint32_t *__restrict__ tile_expert,
                          uint32_t *__restrict__ tile_start, const uint32_t *__restrict__ ids, int pairs, int K,
                          int E, int bm, int max_tiles) {
    extern __shared__ uint32_t align_smem[];
    uint32_t *count = align_smem, *cursor = align_smem + E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const uint32_t e = ids[p];
        if (e < (uint32_t)E) atomicAdd(&count[e], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t start = 0, tile = 0;
        for (int e = 0; e < E; ++e) {
            cursor[e] = start;
            for (uint32_t r = 0; r < count[e] && tile < (uint32_t)max_tiles; r += bm, ++tile) {
                tile_expert[tile] = e;
                tile_start[tile] = start + r;
            }
            start += count[e];
            expert_end[e] = start;
        }
        for (; tile < (uint32_t)max_tiles; ++tile) tile_expert[tile] = NONE;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const uint32_t e = ids[p];
        if (e >= (uint32_t)E) {
            pos_of_pair[p] = NONE;
            continue;
        }
        const uint32_t slot = atomicAdd(&cursor[e], 1u);
        sorted_src[slot] = (uint32_t)(p / K);
        pos_of_pair[p] = slot;
    }
}

constexpr int BN = 128, BK = 32, LDS = BK + 8; // +8: rows 80 bytes apart, off the bank stride

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    const int bytes = valid ? 16 : 0; // 0: the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

template <typename T> struct Wmma;
template <> struct Wmma<__nv_bfloat16> { using type = __nv_bfloat16; };
template <> struct Wmma<__half> { using type = __half; };

// grid (max_tiles, ceil(N / BN)); block WARPS_M * 2 warps. `src` maps a sorted row to its row of
// A (null: the sorted row itself). K a multiple of 8; N a multiple of 32 (SwiGLU) or 16.
template <typename T, int WARPS_M, bool SWIGLU>
__device__ void moe_gemm(T *__restrict__ out, const T *__restrict__ A, const T *__restrict__ W,
                         const uint32_t *__restrict__ src, const uint32_t *__restrict__ tile_expert,
                         const uint32_t *__restrict__ tile_start, const uint32_t *__restrict__ expert_end, int N,
                         int K) {
    constexpr int BM = WARPS_M * 32, THREADS = WARPS_M * 2 * 32;
    constexpr int A_CHUNKS = BM * BK / 8, B_CHUNKS = BN * BK / 8;
    constexpr int A_PER = A_CHUNKS / THREADS, B_PER = B_CHUNKS / THREADS;
    const uint32_t e = tile_expert[blockIdx.x];
    if (e == NONE) return;
    const int row0 = (int)tile_start[blockIdx.x];
    const int rows = min(BM, (int)expert_end[e] - row0);
    const int n0 = blockIdx.y * BN;
    const T *We = W + (size_t)e * N * K;

    extern __shared__ __align__(128) unsigned char gemm_smem[];
    T *As = reinterpret_cast<T *>(gemm_smem);  // [2][BM][LDS]
    T *Bs = As + 2 * BM * LDS;                 // [2][BN][LDS]
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / 2, wn = warp % 2;

    // The source rows this thread loads (fixed over k).
    const T *a_src[A_PER];
    bool a_ok[A_PER];
#pragma unroll
    for (int i = 0; i < A_PER; ++i) {
        const int c = tid + i * THREADS, r = c / (BK / 8);
        a_ok[i] = r < rows;
        const int sorted = row0 + (a_ok[i] ? r : 0);
        const uint32_t s = src ? src[sorted] : (uint32_t)sorted;
        a_src[i] = A + (size_t)s * K + (c % (BK / 8)) * 8;
    }
    auto load = [&](int stage, int k0) {
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const int c = tid + i * THREADS, r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
            const bool ok = a_ok[i] && k0 + kc < K;
            cp_async16(As + (stage * BM + r) * LDS + kc, ok ? a_src[i] + k0 : A, ok);
        }
#pragma unroll
        for (int i = 0; i < B_PER; ++i) {
            const int c = tid + i * THREADS, r = c / (BK / 8), kc = (c % (BK / 8)) * 8;
            const bool ok = n0 + r < N && k0 + kc < K;
            cp_async16(Bs + (stage * BN + r) * LDS + kc, ok ? We + (size_t)(n0 + r) * K + k0 + kc : W, ok);
        }
        cp_async_commit();
    };

    using WT = typename Wmma<T>::type;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[i][j], 0.f);

    const int KT = (K + BK - 1) / BK;
    load(0, 0);
    for (int kt = 0; kt < KT; ++kt) {
        if (kt + 1 < KT) {
            load((kt + 1) & 1, (kt + 1) * BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const T *as = As + ((kt & 1) * BM + wm * 32) * LDS;
        const T *bs = Bs + ((kt & 1) * BN + wn * 64) * LDS;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, WT, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, WT, wmma::col_major> fb[4];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], as + i * 16 * LDS + kk, LDS);
#pragma unroll
            for (int j = 0; j < 4; ++j) wmma::load_matrix_sync(fb[j], bs + j * 16 * LDS + kk, LDS);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }

    // Epilogue through a per-warp f32 scratch (the pipeline buffers are free now): two 16x16
    // tiles per warp, each lane writing 8 contiguous outputs (16 bytes).
    float *scratch = reinterpret_cast<float *>(gemm_smem) + warp * 2 * 256;
    const int er = lane / 2, ec = (lane % 2) * 8;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = wm * 32 + i * 16 + er;
        const bool row_ok = r < rows;
        T *orow = out + (size_t)(row0 + (row_ok ? r : 0)) * (SWIGLU ? N / 2 : N);
        if (SWIGLU) {
#pragma unroll
            for (int jp = 0; jp < 2; ++jp) {
                wmma::store_matrix_sync(scratch, acc[i][2 * jp], 16, wmma::mem_row_major);
                wmma::store_matrix_sync(scratch + 256, acc[i][2 * jp + 1], 16, wmma::mem_row_major);
                __syncwarp();
                const int gate_chunk = (n0 + wn * 64 + jp * 32) / 32;
                if (row_ok && gate_chunk * 32 < N) {
                    alignas(16) T v[8];
#pragma unroll
                    for (int c = 0; c < 8; ++c) {
                        const float g = round_t<T>(scratch[er * 16 + ec + c]);
                        const float u = round_t<T>(scratch[256 + er * 16 + ec + c]);
                        const float s = round_t<T>(g / (1.f + expf(-g)));
                        v[c] = from_f<T>(s * u);
                    }
                    *reinterpret_cast<uint4 *>(orow + gate_chunk * 16 + ec) = *reinterpret_cast<uint4 *>(v);
                }
                __syncwarp();
            }
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
                __syncwarp();
                const int col = n0 + wn * 64 + j * 16 + ec;
                if (row_ok && col < N) {
                    alignas(16) T v[8];
#pragma unroll
                    for (int c = 0; c < 8; ++c) v[c] = from_f<T>(scratch[er * 16 + ec + c]);
                    *reinterpret_cast<uint4 *>(orow + col) = *reinterpret_cast<uint4 *>(v);
                }
                __syncwarp();
            }
        }
    }
}

// grid T, block ceil(H / 8) threads (each 8 columns); y [pairs, H] in sorted order.
template <typename T>
__device__ void moe_combine(T *__restrict__ out, const T *__restrict__ y, const float *__restrict__ weights,
                            const uint32_t *__restrict__ pos_of_pair, const T *__restrict__ shared, int K, int H) {
    const int t = blockIdx.x, c0 = threadIdx.x * 8;
    if (c0 >= H) return;
    float acc[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = 0.f;
    for (int k = 0; k < K; ++k) {
        const uint32_t p = pos_of_pair[(size_t)t * K + k];
        if (p == NONE) continue;
        const float w = weights[(size_t)t * K + k];
        alignas(16) T v[8];
        *reinterpret_cast<uint4 *>(v) = *reinterpret_cast<const uint4 *>(y + (size_t)p * H + c0);
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] += w * to_f(v[c]);
    }
    if (shared) {
        alignas(16) T v[8];
        *reinterpret_cast<uint4 *>(v) = *reinterpret_cast<const uint4 *>(shared + (size_t)t * H + c0);
#pragma unroll
        for (int c = 0; c < 8; ++c) acc[c] += to_f(v[c]);
    }
    alignas(16) T o[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) o[c] = from_f<T>(acc[c]);
    *reinterpret_cast<uint4 *>(out + (size_t)t * H + c0) = *reinterpret_cast<uint4 *>(o);
}

} // namespace

extern "C" __global__ void moe_route(uint32_t *ids, float *weights, const float *logits, const float *bias, int tokens,
                                     int E, int K, int G, int KG, int softmax, int norm_topk, float scale) {
    route_tokens(ids, weights, logits, bias, tokens, E, K, G, KG, softmax, norm_topk, scale);
}

extern "C" __global__ void moe_align(uint32_t *sorted_src, uint32_t *pos_of_pair, uint32_t *expert_end,
                                     uint32_t *tile_expert, uint32_t *tile_start, const uint32_t *ids, int pairs,
                                     int K, int E, int bm, int max_tiles) {
    align_pairs(sorted_src, pos_of_pair, expert_end, tile_expert, tile_start, ids, pairs, K, E, bm, max_tiles);
}

#define MOE_OPS(T, SUF)                                                                                        \
    extern "C" __global__ void moe_gemm_swiglu_bm64_##SUF(T *out, const T *A, const T *W, const uint32_t *src,  \
                                                          const uint32_t *te, const uint32_t *ts,               \
                                                          const uint32_t *ee, int N, int K) {                   \
        moe_gemm<T, 2, true>(out, A, W, src, te, ts, ee, N, K);                                                 \
    }                                                                                                          \
    extern "C" __global__ void moe_gemm_swiglu_bm128_##SUF(T *out, const T *A, const T *W, const uint32_t *src, \
                                                           const uint32_t *te, const uint32_t *ts,              \
                                                           const uint32_t *ee, int N, int K) {                  \
        moe_gemm<T, 4, true>(out, A, W, src, te, ts, ee, N, K);                                                 \
    }                                                                                                          \
    extern "C" __global__ void moe_gemm_bm64_##SUF(T *out, const T *A, const T *W, const uint32_t *src,         \
                                                   const uint32_t *te, const uint32_t *ts, const uint32_t *ee,  \
                                                   int N, int K) {                                              \
        moe_gemm<T, 2, false>(out, A, W, src, te, ts, ee, N, K);                                                \
    }                                                                                                          \
    extern "C" __global__ void moe_gemm_bm128_##SUF(T *out, const T *A, const T *W, const uint32_t *src,        \
                                                    const uint32_t *te, const uint32_t *ts, const uint32_t *ee, \
                                                    int N, int K) {                                             \
        moe_gemm<T, 4, false>(out, A, W, src, te, ts, ee, N, K);                                                \
    }                                                                                                          \
    extern "C" __global__ void moe_combine_##SUF(T *out, const T *y, const float *w, const uint32_t *pos,        \
                                                 const T *shared, int K, int H) {                               \
        moe_combine<T>(out, y, w, pos, shared, K, H);                                                           \
    }

MOE_OPS(__nv_bfloat16, bf16)
MOE_OPS(__half, f16)
