// Mixture-of-experts layers on the device (ponder): routing, grouping by expert, two grouped
// GEMMs on tensor cores, and the weighted combine. The reference is the candle composition in
// src/ops/moe.rs; every value it rounds to the storage dtype is rounded here at the
// same place.
//
// moe_route: one warp per token over the f32 router logits [T, E]: scores (sigmoid or softmax),
//   the selection-only bias, the group limit (groups ranked by the sum of their two best biased
//   scores, ties to the lower index), top-k by biased score (ties to the lower index), weights =
//   unbiased scores, optionally divided by their sum, times a scale. Writes ids [T, K] u32 and
//   weights [T, K] f32. moe_route_reg_p*: the same with the scores in registers, for the shapes
//   that allow it (up to 256 experts).
// moe_count, moe_offsets, moe_scatter: count the (token, k) pairs per expert, lay them out
//   expert by expert (sorted position of each pair, the source row token = pair / K of each
//   sorted position) and cut every expert's rows into tiles of BM rows for the GEMMs (unused tile
//   slots, at the end: expert ~0).
// moe_gemm_*: out[r] = A[src(r)] · W[e]^T for the rows r of each tile, W [E, N, K] row-major.
//   bf16/f16 mma.sync m16n8k16 with f32 accumulators fed by ldmatrix from XOR-swizzled shared
//   tiles, block tiles BM x 128 x 64, three cp.async stages, four warps (64 x 32 warp tiles at
//   BM 64, 64 x 64 at BM 128).
//   The SwiGLU variant takes gate and up rows interleaved in chunks of 16 (chunk 2c = gate rows
//   16c.., chunk 2c+1 = up rows 16c..), so that each warp holds a gate column and its up column
//   in the same thread, and writes T(T(silu(gate)) * up) [rows, N/2]; the plain variant writes
//   T(acc) [rows, N]; the f32 variant (the router: one matrix, bf16 x against the f32 router
//   weights split in three bf16 parts hi + mid + lo, each product exact in f32) writes acc.
// moe_wgmma_*: the same tiles' GEMMs on Hopper (sm_90a) at 128 x 256 tiles, persistent and
//   warp-specialised (ws_gemm below), with the same epilogues; moe_wgmma_f32out_bf16 is the
//   router's, on one dense matrix with k slices.
// moe_combine_*: out[t] = T(sum_k w[t,k] * y[pos(t,k)] (+ shared[t])), f32 sums in k order; with a
//   residual stream, out[t] = T(residual[t] + that) (the add a pre-norm block does next).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "cp_async.cuh"
#include "mbarrier.cuh"
#include "mma.cuh"

namespace {

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

// The warp's best (value, index) over v[0 .. n), NaN entries skipped; every lane gets it (index
// 0x7fffffff when all are NaN).
__device__ __forceinline__ void warp_best(const float *v, int n, float &bv, int &bi) {
    bv = -INFINITY;
    bi = 0x7fffffff;
    for (int j = threadIdx.x & 31; j < n; j += 32)
        if (!isnan(v[j]) && better(v[j], j, bv, bi)) {
            bv = v[j];
            bi = j;
        }
    warp_argmax(bv, bi);
}

// Folds v into the two largest values seen (a >= b).
__device__ __forceinline__ void push_top2(float &a, float &b, float v) {
    if (v > a) {
        b = a;
        a = v;
    } else if (v > b) {
        b = v;
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
            for (int e = g * per; e < (g + 1) * per; ++e) push_top2(a, b, choice[e]);
            group[g] = a + b;
        }
        __syncwarp();
        // Keep the KG best groups; the others' experts cannot be chosen.
        for (int r = 0; r < KG; ++r) {
            float bv;
            int bi;
            warp_best(group, G, bv, bi);
            // NaN marks a kept group; no candidate left (NaN scores) keeps none.
            if (lane == 0 && bi < G) group[bi] = NAN;
            __syncwarp();
        }
        for (int e = lane; e < E; e += 32)
            if (!isnan(group[e / per])) choice[e] = NAN;
        __syncwarp();
    }
    // Top-k by biased score; NaN marks experts not choosable (excluded groups, already chosen).
    float total = 0.f;
    for (int k = 0; k < K; ++k) {
        float bv;
        int bi;
        warp_best(choice, E, bv, bi);
        if (lane == 0) {
            // No expert left to choose (NaN scores: a non-finite hidden state, which the engine
            // fails on its own): no expert, weight 0, which the grouping skips.
            const bool found = bi < E;
            ids[(size_t)t * K + k] = found ? (uint32_t)bi : NONE;
            weights[(size_t)t * K + k] = found ? score[bi] : 0.f;
            if (found) {
                total += score[bi];
                choice[bi] = NAN;
            }
        }
        __syncwarp();
    }
    if (lane == 0) {
        const float norm = norm_topk ? total + 1e-20f : 1.f;
        for (int k = 0; k < K; ++k) weights[(size_t)t * K + k] = weights[(size_t)t * K + k] / norm * scale;
    }
}

// route_tokens with the scores in registers: lane l holds experts l * PER .. l * PER + PER - 1
// (E <= 32 PER, K <= 32, and with groups, E / G a power-of-two multiple of PER: a group spans
// whole lanes). The same choice and weights, bit for bit, in fewer instructions: no shared
// memory, the group ranks from one pass over the groups' scores, and each top-k round rescans
// only the winning lane's experts.
template <int PER>
__device__ void route_tokens_reg(uint32_t *__restrict__ ids, float *__restrict__ weights, const float *__restrict__ logits,
                                 const float *__restrict__ bias, int tokens, int E, int K, int G, int KG, int softmax,
                                 int norm_topk, float scale) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= tokens) return;
    const float *z = logits + (size_t)t * E;
    const int e0 = lane * PER;
    float score[PER], choice[PER];
    if (softmax) {
        float m = -INFINITY;
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (e0 + i < E) m = fmaxf(m, z[e0 + i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
#pragma unroll
        for (int i = 0; i < PER; ++i) score[i] = e0 + i < E ? expf(z[e0 + i] - m) : 0.f;
        // The total in expert order, as the reference sums (the padding adds exact zeros).
        float total = 0.f;
        for (int l = 0; l < 32; ++l)
#pragma unroll
            for (int i = 0; i < PER; ++i) total += __shfl_sync(0xffffffffu, score[i], l);
#pragma unroll
        for (int i = 0; i < PER; ++i) score[i] = score[i] / total;
    } else {
#pragma unroll
        for (int i = 0; i < PER; ++i) score[i] = e0 + i < E ? 1.f / (1.f + expf(-z[e0 + i])) : 0.f;
    }
    // NaN: not choosable (padding, and below excluded groups and chosen experts).
#pragma unroll
    for (int i = 0; i < PER; ++i) choice[i] = e0 + i < E ? (bias ? score[i] + bias[e0 + i] : score[i]) : NAN;
    if (G > 1) {
        // The two best of the group: this lane's, merged over the group's L lanes.
        float a = -INFINITY, b = -INFINITY;
#pragma unroll
        for (int i = 0; i < PER; ++i) push_top2(a, b, choice[i]);
        const int L = E / G / PER;
        for (int o = 1; o < L; o <<= 1) {
            const float oa = __shfl_xor_sync(0xffffffffu, a, o), ob = __shfl_xor_sync(0xffffffffu, b, o);
            b = fmaxf(fminf(a, oa), fmaxf(b, ob));
            a = fmaxf(a, oa);
        }
        // A group is kept when fewer than KG groups rank before it (NaN sums rank nowhere): the
        // KG rounds of picking the best group, in one pass.
        const int mine = lane / L;
        const float gs = a + b;
        int before = 0;
        for (int g = 0; g < G; ++g) {
            const float og = __shfl_sync(0xffffffffu, gs, g * L);
            before += !isnan(og) && better(og, g, gs, mine);
        }
        if (isnan(gs) || before >= KG)
#pragma unroll
            for (int i = 0; i < PER; ++i) choice[i] = NAN;
    }
    auto lane_best = [&](float &bv, int &bi) {
        bv = -INFINITY;
        bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < PER; ++i)
            if (!isnan(choice[i]) && better(choice[i], e0 + i, bv, bi)) {
                bv = choice[i];
                bi = e0 + i;
            }
    };
    float bv;
    int bi;
    lane_best(bv, bi);
    // Lane k keeps pick k; every lane adds the picks' scores in pick order.
    float total = 0.f, my_w = 0.f;
    uint32_t my_id = NONE;
    for (int k = 0; k < K; ++k) {
        float v = bv;
        int e = bi;
        warp_argmax(v, e);
        // No expert left (NaN scores): the rest stay NONE with weight 0, as in route_tokens.
        if (e >= E) break;
        const int owner = e / PER;
        float s = 0.f;
        if (lane == owner) {
#pragma unroll
            for (int i = 0; i < PER; ++i)
                if (e0 + i == e) {
                    s = score[i];
                    choice[i] = NAN;
                }
            lane_best(bv, bi);
        }
        s = __shfl_sync(0xffffffffu, s, owner);
        total += s;
        if (lane == k) {
            my_id = (uint32_t)e;
            my_w = s;
        }
    }
    if (lane < K) {
        const float norm = norm_topk ? total + 1e-20f : 1.f;
        ids[(size_t)t * K + lane] = my_id;
        weights[(size_t)t * K + lane] = my_w / norm * scale;
    }
}

// Grouping by expert, in three launches (one block could not keep up at 65k pairs: 0.16 ms).
// moe_count: grid ceil(pairs / blockDim); shared memory E u32. Adds each block's histogram of
// the pairs' experts into `counts` [E] (zeroed by the caller).
__device__ void count_pairs(uint32_t *__restrict__ counts, const uint32_t *__restrict__ ids, int pairs, int E) {
    extern __shared__ uint32_t hist[];
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    __syncthreads();
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < pairs && ids[p] < (uint32_t)E) atomicAdd(&hist[ids[p]], 1u);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        if (hist[e]) atomicAdd(&counts[e], hist[e]);
}

// moe_offsets: one block of blockDim threads (a multiple of 32, at most 1024); shared memory
// 2 * E u32. Lays the experts' rows out one after the other (`cursor` = each expert's first
// sorted row, `expert_end` = one past its last) and cuts every expert's rows into tiles of `bm`
// in expert order (unused tile slots at the end: expert NONE). Thread i sums a contiguous run of
// experts; a scan over the threads' sums gives every run its first row and tile.
__device__ void expert_offsets(uint32_t *__restrict__ cursor, uint32_t *__restrict__ expert_end,
                               uint32_t *__restrict__ tile_expert, uint32_t *__restrict__ tile_start,
                               const uint32_t *__restrict__ counts, int E, int bm, int max_tiles) {
    extern __shared__ uint32_t offs[];
    uint32_t *start = offs, *first_tile = offs + E;
    __shared__ uint64_t warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int per = (E + blockDim.x - 1) / blockDim.x, e0 = min(E, (int)threadIdx.x * per), e1 = min(E, e0 + per);
    // (rows << 32) | tiles: both sums stay below 2^32, so one 64-bit scan carries both.
    uint64_t mine = 0;
    for (int e = e0; e < e1; ++e) mine += ((uint64_t)counts[e] << 32) | ((counts[e] + bm - 1) / bm);
    uint64_t incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const uint64_t v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    uint64_t before = incl - mine, total = 0;
    for (int w = 0; w < warps; ++w) {
        if (w < warp) before += warp_sums[w];
        total += warp_sums[w];
    }
    uint32_t row = (uint32_t)(before >> 32), tile = (uint32_t)before;
    for (int e = e0; e < e1; ++e) {
        start[e] = row;
        first_tile[e] = tile;
        row += counts[e];
        tile += (counts[e] + bm - 1) / bm;
    }
    const uint32_t total_tiles = min((uint32_t)total, (uint32_t)max_tiles);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        cursor[e] = start[e];
        expert_end[e] = start[e] + counts[e];
        for (uint32_t r = 0, t = first_tile[e]; r < counts[e] && t < (uint32_t)max_tiles; r += bm, ++t) {
            tile_expert[t] = e;
            tile_start[t] = start[e] + r;
        }
    }
    for (int t = total_tiles + threadIdx.x; t < max_tiles; t += blockDim.x) tile_expert[t] = NONE;
}

// moe_scatter: grid ceil(pairs / blockDim). Places each pair at the next free row of its expert
// (the order within an expert is the atomics' order; no output depends on it: each row's
// products and sums are its own) and records the token the row reads.
__device__ void scatter_pairs(uint32_t *__restrict__ sorted_src, uint32_t *__restrict__ pos_of_pair,
                              uint32_t *__restrict__ cursor, const uint32_t *__restrict__ ids, int pairs, int K,
                              int E) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= pairs) return;
    const uint32_t e = ids[p];
    if (e >= (uint32_t)E) {
        pos_of_pair[p] = NONE;
        return;
    }
    const uint32_t slot = atomicAdd(&cursor[e], 1u);
    sorted_src[slot] = (uint32_t)(p / K);
    pos_of_pair[p] = slot;
}

constexpr int BN = 128, BK = 64, STAGES = 3, ROW_BYTES = BK * 2;

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// Half `h` (0: bytes 0-1, 1: bytes 2-3) of four E4M3 values as an f16 pair, exactly (E4M3 ⊂ f16).
__device__ __forceinline__ uint32_t e4m3x2_f16(uint32_t word, int h) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(word >> (16 * h)), __NV_E4M3);
    return static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
}

// The FP8 (E4M3 x E4M3) step over the same 32 bytes of every row: m16n8k32, whose fragments
// hold bytes 4t .. 4t+3 (and 16 + 4t ..) of a row where m16n8k16's hold two 16-bit values there,
// so the same ldmatrix loads feed it. E4M3 MMAs need sm_89: an older target gets a trap (the host
// routes FP8 experts elsewhere there), so that the module still loads. Hopper has no E4M3
// mma.sync of its own (the compiler emulates it), and its results measured 1.4 % off the f32
// composition on the H100; there the step is two f16 m16n8k16 MMAs on the values converted
// exactly, each lane's logical k pairs (2t, 2t+1) and (2t+8, 2t+9) mapped onto its bytes 4t, 4t+1
// and 4t+2, 4t+3 (then 16 + ..) for A and B alike, since a dot product does not care about the
// order of k: exact products, f32 sums.
__device__ __forceinline__ void mma_e4m3(float *c, const uint32_t *a, const uint32_t *b) {
#if __CUDA_ARCH__ < 890
    __trap();
#elif __CUDA_ARCH__ == 900
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const uint32_t g = a[2 * s], g8 = a[2 * s + 1], w = b[s]; // rows g and g + 8, k 16 s + 4t ..
        const uint32_t af[4] = {e4m3x2_f16(g, 0), e4m3x2_f16(g8, 0), e4m3x2_f16(g, 1), e4m3x2_f16(g8, 1)};
        const uint32_t bf[2] = {e4m3x2_f16(w, 0), e4m3x2_f16(w, 1)};
        mma16816<__half>(c, af, bf);
    }
#else
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Byte offset of 16-byte chunk `c` (of 8) of row `r` in a tile of 128-byte rows: chunks are
// XOR-swizzled by row so that the same chunk of eight consecutive rows falls in distinct banks.
__device__ __forceinline__ unsigned tile_offset(int r, int c) { return r * ROW_BYTES + ((c ^ (r & 7)) << 4); }

enum Epilogue { SWIGLU, PLAIN, F32_OUT };

// The cp.async loads of one block's A and W tiles, THREADS threads over BM rows of A (gathered
// through `src`, rows past `rows` zero-filled) and BN rows of W (rows past N zero-filled), each
// thread always chunk tid % 8 of its rows. Column k of A is its column k % a_cols.
template <typename T, int BM, int THREADS> struct TileLoader {
    static constexpr int A_PER = BM * 8 / THREADS, B_PER = BN * 8 / THREADS; // 16-byte chunks per thread
    static constexpr int PER = 16 / sizeof(T);                               // elements a chunk
    static constexpr int A_BYTES = BM * ROW_BYTES;
    const T *a_src[A_PER];
    bool a_ok[A_PER];
    const T *b_src;
    int tid, kc;

    __device__ __forceinline__ TileLoader(const T *A, const T *We, const uint32_t *src, int row0, int rows, int n0,
                                          int K, int a_cols) {
        tid = threadIdx.x;
        kc = tid & 7;
#pragma unroll
        for (int i = 0; i < A_PER; ++i) {
            const int r = tid / 8 + i * (THREADS / 8);
            a_ok[i] = r < rows;
            const int sorted = row0 + (a_ok[i] ? r : 0);
            const uint32_t s = src ? src[sorted] : (uint32_t)sorted;
            a_src[i] = A + (size_t)s * a_cols + kc * PER;
        }
        b_src = We + (size_t)(n0 + tid / 8) * K + kc * PER;
    }

    // Stage at shared address `base` <- the ROW_BYTES of columns from k0 (those before k_end).
    __device__ __forceinline__ void load(unsigned base, int k0, int k_end, int a_cols, int n0, int N, int K,
                                         const T *A, const T *W) const {
        const bool k_ok = k0 + kc * PER < k_end;
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
    }
};

// silu(gate) · up from f32 accumulators, gate, up and the activation rounded to T as the
// unfused ops round. The hardware exponential (2 + 1.17·|g| ulp of f32: ≈ 1e-5 relative at the
// largest finite gates) and an approximate division (2 ulp) instead of expf's and div.rn's
// instruction sequences, since this is most of the SwiGLU epilogue and no MMA overlaps it: both
// errors stay far below a bf16 or f16 rounding step, though a value on a rounding boundary may
// round one step apart from the dense `silu_mul`. A gate so negative that 1 + e^-g passes 2^126
// gives -0 (silu's limit is -0 there to within 1e-36).
template <typename T> __device__ __forceinline__ float swiglu(float gate, float up) {
    const float g = round_t<T>(gate);
    return round_t<T>(__fdividef(g, 1.f + __expf(-g))) * round_t<T>(up);
}

// Writes one output row's share of NT n8 tiles from the accumulators, `frag(j, v)` being the
// thread's value of tile j at column 2 * (lane % 4) + v (mma.sync's and wgmma's layout alike):
// T(acc) or f32 acc at columns n_base + 8 j + .., or for SWIGLU, per 32 columns (one gate/up
// chunk pair: tiles 0-1 gate, 2-3 the matching up) T(T(silu(gate)) * up) at the pair's 16 output
// columns.
template <typename T, typename O, Epilogue EPI, int NT, typename Frag>
__device__ __forceinline__ void store_row(O *orow, int n_base, int N, Frag frag) {
    const int lane = threadIdx.x & 31;
    if constexpr (EPI == SWIGLU) {
#pragma unroll
        for (int q = 0; q < NT / 4; ++q) {
            const int pair = (n_base + q * 32) / 32;
            if (pair * 32 >= N) continue;
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float o[2];
#pragma unroll
                for (int v = 0; v < 2; ++v) o[v] = swiglu<T>(frag(q * 4 + j, v), frag(q * 4 + j + 2, v));
                const int col = pair * 16 + j * 8 + (lane & 3) * 2;
                T pr[2] = {from_f<T>(o[0]), from_f<T>(o[1])};
                *reinterpret_cast<uint32_t *>(orow + col) = *reinterpret_cast<uint32_t *>(pr);
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int col = n_base + j * 8 + (lane & 3) * 2;
            if (col >= N) continue;
            if constexpr (EPI == F32_OUT) {
                *reinterpret_cast<float2 *>(orow + col) = make_float2(frag(j, 0), frag(j, 1));
            } else {
                T pr[2] = {from_f<T>(frag(j, 0)), from_f<T>(frag(j, 1))};
                *reinterpret_cast<uint32_t *>(orow + col) = *reinterpret_cast<uint32_t *>(pr);
            }
        }
    }
}

// out[r] = A[src(r)] · W[e]^T over the rows r of each tile. grid (ceil(N / BN), tiles): the
// column tiles of one row tile run back to back, so A's tile is read from DRAM once (the down
// GEMM's A is larger than L2) and W[e]'s slices stay in L2 across an expert's row tiles; block
// BM / 64 * BN / WTN warps, each a 64 x WTN warp tile of m16n8k16 MMAs. Tiles come from moe_offsets
// (`tile_expert` / `tile_start` / `expert_end`), or, with `tile_expert` null, cut one matrix of
// `dense_rows` rows (expert 0). `src` maps a sorted row to its row of A (null: the row itself);
// column k of the K columns reads A's column k % a_cols (a_cols = K, or K / 3 for the router's
// three-way split weights). Slice z = blockIdx.z covers columns [z * k_chunk, (z + 1) * k_chunk)
// (k_chunk a multiple of 64) and, in dense mode, writes its own out[z] [dense_rows, N] (F32_OUT
// partial sums, added in slice order by moe_sum_slices). K and a_cols multiples of 8 (of 64
// when a_cols < K); N a multiple of 32 for SWIGLU, else of 8.
// With In = uint8_t (W8A8: A and W in E4M3) a k tile is 128 columns of the same 128 bytes a row,
// multiplied by m16n8k32 steps; the f32 sums are scaled by the row's `a_scale` (A's row, so the
// token's for a gathered A) and the column's `w_scale` ([E, N]) before the epilogue. K a
// multiple of 16 there; one k slice.
template <typename T, typename O, int BM, int WTN, Epilogue EPI, typename In = T>
__device__ void moe_gemm(O *__restrict__ out, const In *__restrict__ A, const In *__restrict__ W,
                         const uint32_t *__restrict__ src, const uint32_t *__restrict__ tile_expert,
                         const uint32_t *__restrict__ tile_start, const uint32_t *__restrict__ expert_end, int N,
                         int K, int a_cols, int dense_rows, int k_chunk, const float *__restrict__ a_scale = nullptr,
                         const float *__restrict__ w_scale = nullptr) {
    constexpr int WM = BM / 64, WN = BN / WTN, THREADS = WM * WN * 32, NT = WTN / 8; // NT n8 tiles per warp
    constexpr int A_BYTES = BM * ROW_BYTES, STAGE_BYTES = (BM + BN) * ROW_BYTES;
    constexpr bool FP8 = sizeof(In) == 1;
    constexpr int BKE = ROW_BYTES / sizeof(In); // columns a k tile
    uint32_t e = 0;
    int row0, rows;
    if (tile_expert) {
        e = tile_expert[blockIdx.y];
        if (e == NONE) return;
        row0 = (int)tile_start[blockIdx.y];
        rows = min(BM, (int)expert_end[e] - row0);
    } else {
        row0 = blockIdx.y * BM;
        rows = min(BM, dense_rows - row0);
    }
    const int n0 = blockIdx.x * BN;
    const In *We = W + (size_t)e * N * K;
    const int k_begin = blockIdx.z * k_chunk, k_end = min(K, k_begin + k_chunk);
    out += (size_t)blockIdx.z * (tile_expert ? 0 : dense_rows) * (EPI == SWIGLU ? N / 2 : N);

    extern __shared__ __align__(128) unsigned char gemm_smem[];
    const unsigned smem = (unsigned)__cvta_generic_to_shared(gemm_smem);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wm = warp / WN, wn = warp % WN;
    const TileLoader<In, BM, THREADS> tiles(A, We, src, row0, rows, n0, K, a_cols);
    auto load = [&](int stage, int k0) { tiles.load(smem + stage * STAGE_BYTES, k0, k_end, a_cols, n0, N, K, A, W); };

    float acc[4][NT][4]; // [m16 tile][n8 tile][fragment]
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 4; ++v) acc[i][j][v] = 0.f;

    const int KT = (k_end - k_begin + BKE - 1) / BKE;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load(s, k_begin + s * BKE);
        cp_async_commit();
    }
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        // Refill the stage every warp finished reading in the previous iteration.
        if (kt + STAGES - 1 < KT) load((kt + STAGES - 1) % STAGES, k_begin + (kt + STAGES - 1) * BKE);
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
                for (int j = 0; j < NT; ++j) {
                    if constexpr (FP8)
                        mma_e4m3(acc[i][j], a[i], b[j]);
                    else
                        mma16816<T>(acc[i][j], a[i], b[j]);
                }
        }
    }
    cp_async_wait<0>();

    // Epilogue from registers: fragment v of n8 tile j holds row lane / 4 (+ 8 for v >= 2),
    // columns 2 * (lane % 4) + (v & 1) of the tile.
    if constexpr (FP8) {
        // The sums scaled back: the row's activation scale times the column's weight scale.
        float ws[NT][2];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int v = 0; v < 2; ++v) {
                const int col = min(n0 + wn * WTN + j * 8 + (lane & 3) * 2 + v, N - 1); // past N: not stored
                ws[j][v] = w_scale[(size_t)e * N + col];
            }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = min(wm * 64 + i * 16 + (lane >> 2) + h * 8, rows - 1); // past rows: not stored
                const float sa = a_scale[src ? src[row0 + r] : (uint32_t)(row0 + r)];
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int v = 0; v < 2; ++v) acc[i][j][h * 2 + v] *= sa * ws[j][v];
            }
    }
    const int out_w = EPI == SWIGLU ? N / 2 : N;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm * 64 + i * 16 + (lane >> 2) + h * 8;
            if (r >= rows) continue;
            store_row<T, O, EPI, NT>(out + (size_t)(row0 + r) * out_w, n0 + wn * WTN, N,
                                     [&](int j, int v) { return acc[i][j][h * 2 + v]; });
        }
}

// Hopper's warpgroup MMA (sm_90a): D[64 x 256] += A[64 x 16] · B[256 x 16]^T with A and B read
// from shared memory through descriptors (K-major, 128-byte swizzle: the tile layout of
// tile_offset), accumulating in place.
template <typename T> __device__ __forceinline__ void wgmma_m64n256k16(float *d, uint64_t desc_a, uint64_t desc_b);
// One specialisation per element type (the PTX names it: bf16, f16); the operands are the same.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_ASM(SHAPE_TYPES, TAIL) \
    asm volatile("{\n" \
                 ".reg .pred p;\n" \
                 "setp.ne.b32 p, %130, 0;\n" \
                 "wgmma.mma_async.sync.aligned." SHAPE_TYPES " " \
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, " \
                 "%128, %129, " TAIL ";\n" \
                 "}\n" \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
                 : "l"(desc_a), "l"(desc_b), "r"(1));
#define WGMMA_M64N256K16_ASM(PTX_TYPE) WGMMA_ASM("m64n256k16.f32." PTX_TYPE "." PTX_TYPE, "p, 1, 1, 0, 0")
#else
#define WGMMA_ASM(SHAPE_TYPES, TAIL)
#define WGMMA_M64N256K16_ASM(PTX_TYPE)
#endif
#define WGMMA_M64N256K16(T, PTX_TYPE) \
    template <> __device__ __forceinline__ void wgmma_m64n256k16<T>(float *d, uint64_t desc_a, uint64_t desc_b) { \
        WGMMA_M64N256K16_ASM(PTX_TYPE) \
    }
WGMMA_M64N256K16(__nv_bfloat16, "bf16")
WGMMA_M64N256K16(__half, "f16")
#undef WGMMA_M64N256K16

#undef WGMMA_M64N256K16_ASM
#undef WGMMA_ASM

// The FP8 step at half the width, D[64 x 128] (+)= A[64 x 32] · B[128 x 32]^T in E4M3, with
// `accumulate` false starting D afresh (wgmma's scale-d): the promoted FP8 GEMM sums each k tile
// in a fresh fragment and adds it to its f32 total on the CUDA cores.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float *d, uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
                 "%64, %65, p, 1, 1;\n"
                 "}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(desc_a), "l"(desc_b), "r"((int)accumulate));
#endif
}

// Ties registers a wgmma wrote to this point of the program: the wgmma asm defines them when it
// is issued, so without this the compiler could move their readers above the wait_group that
// makes them valid (CUTLASS's warpgroup_fence_operand).
template <int N> __device__ __forceinline__ void fence_operands(float *r) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// A shared-memory matrix descriptor for wgmma: K-major rows of 128 bytes, 128-byte swizzle,
// eight-row groups 1024 bytes apart (the layout tile_offset and a 128-byte-swizzled TMA box
// write; tiles 1024-byte aligned).
__device__ __forceinline__ uint64_t smem_desc(unsigned addr) {
    return (uint64_t)((addr >> 4) & 0x3FFF) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// A TMA descriptor (CUtensorMap) passed by value as a __grid_constant__ kernel parameter.
struct alignas(64) TmaMap {
    uint64_t opaque[16];
};

// One arrival on `bar`, made by the hardware once every cp.async this thread issued before has
// completed (counted against the barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_arrive(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Box (c0, c1) of the 2-D tensor `map` into shared memory at `dst`, completing its bytes on `bar`.
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaMap *map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// The grouped GEMM of moe_gemm at 128 x BN tiles on Hopper (BN 256, or 128 for E4M3):
// persistent (CTAs stride over the work items of WsShape, column tiles of a row tile
// consecutive, so an A tile and an expert's W slices are read from DRAM about once) and
// warp-specialised. Warpgroup 0 produces: W tiles [BN rows x 128 bytes] by TMA from `wmap` (W as
// a 2-D tensor [E * N, K], boxes of 128 bytes x BN rows with 128-byte swizzle; rows past an expert's N are the next expert's or, past the end, zeros, and land only
// in columns the epilogue skips), A tiles [128 x 64] gathered through `src` by cp.async (rows
// past the tile's and columns past the slice's end zero-filled), into WS_STAGES stages.
// Warpgroups 1 and 2 consume: 64 rows x BN columns each (wgmma m64n256k16, or m64n128k32 in
// E4M3), keeping one k tile's MMAs in flight (16-bit), and write the tile with moe_gemm's epilogues (PLAIN through a shared
// buffer, ws_epilogue; the others from registers) while the producer fills the next tile's stages.
// Stage s is handed over by two mbarriers: full[s] (129 arrivals: thread 0's with the TMA's
// expected bytes, and every producer thread's, made by the hardware once that thread's cp.async
// for the stage have landed — so the producer never waits for its own copies and A is fetched
// as far ahead as W) and empty[s] (one arrival per consumer warp once its MMAs reading the stage
// are done). cp.async writes through the generic proxy and wgmma reads through the async one: a
// consumer fences between acquiring full[s] and its MMAs.
// W8A8 (E4M3) takes 128-column tiles instead: its sums are promoted (below), which needs a second
// accumulator fragment, and two of m64n256's would not fit a consumer's registers.
constexpr int WS_BM = 128, WS_BN = 256, WS_BN_FP8 = 128, WS_STAGES = 4, WS_THREADS = 384;
constexpr int WS_A_BYTES = WS_BM * ROW_BYTES;
template <typename In> constexpr int ws_bn() { return sizeof(In) == 1 ? WS_BN_FP8 : WS_BN; }
// Each consumer warpgroup's epilogue buffer: its 64 rows × 256 bytes of output (after the stages),
// for the PLAIN epilogue only. Stored straight from registers, a plain tile of 256 columns fills
// the store queue with 4-byte stores scattered over 8 rows; SWIGLU's tile is half as wide and its
// activation math hides the stores, so for it the buffer's two barriers per pass cost more than
// they save (measured on the H200). F32_OUT keeps the register path too.
constexpr int WS_EPI_ROW = 256, WS_EPI_BYTES = 64 * WS_EPI_ROW;
template <Epilogue EPI> constexpr int ws_epi_buffers() { return EPI == PLAIN ? 2 * WS_EPI_BYTES : 0; }

// Named barrier `id` (1..15; 0 is __syncthreads') for `threads` threads.
__device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Writes a consumer warpgroup's 64 × BN accumulator tile (wgmma's fragment layout: acc[j * 4 +
// h * 2 + v] holds row warp * 16 + lane / 4 + 8 h, column 8 j + 2 (lane % 4) + v) to `out` through
// its shared buffer `buf`, 256 bytes of output columns per pass: every thread puts its fragments
// in (16-byte chunks XOR-swizzled by the row: the 8 rows of one fragment store hit distinct
// banks), then the rows go out as 16-byte stores, two whole rows per warp — full sectors instead
// of 16 scattered bytes per row. `row_base`: the warpgroup's first output row; rows from
// `rows_here` on and columns from `out_w` on are not written. out_w must be a multiple of 8 (the
// host checks: hidden % 8 == 0) so that every 16-byte store is aligned and inside its row.
// `barrier`: the warpgroup's own named barrier.
template <typename T, int BN>
__device__ __forceinline__ void ws_epilogue(T *__restrict__ out, int out_w, int row_base, int rows_here, int col0,
                                            const float *acc, unsigned buf, int barrier) {
    constexpr int PASS_COLS = WS_EPI_ROW / (int)sizeof(T), CHUNK = 16 / (int)sizeof(T);
    const int tid = threadIdx.x & 127, warp = tid / 32, lane = tid & 31;
#pragma unroll
    for (int pass = 0; pass < BN / PASS_COLS; ++pass) {
        named_barrier(barrier, 128); // the previous pass's rows are out
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp * 16 + (lane >> 2) + h * 8;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                const int col = j * 8 + (lane & 3) * 2;
                if (col / PASS_COLS != pass) continue;
                const int byte = (col - pass * PASS_COLS) * (int)sizeof(T);
                T pr[2] = {from_f<T>(acc[j * 4 + h * 2]), from_f<T>(acc[j * 4 + h * 2 + 1])};
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(buf + row * WS_EPI_ROW + ((((byte >> 4) ^ (row & 7)) << 4) | (byte & 15))),
                             "r"(*reinterpret_cast<uint32_t *>(pr)));
            }
        }
        named_barrier(barrier, 128); // the pass's rows are in
#pragma unroll
        for (int i = 0; i < 64 * (WS_EPI_ROW / 16) / 128; ++i) {
            const int chunk = tid + 128 * i, row = chunk / (WS_EPI_ROW / 16), c = chunk % (WS_EPI_ROW / 16);
            const int col = col0 + pass * PASS_COLS + c * CHUNK;
            if (row >= rows_here || col >= out_w) continue;
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(buf + row * WS_EPI_ROW + ((c ^ (row & 7)) << 4)));
            *reinterpret_cast<uint4 *>(out + (size_t)(row_base + row) * out_w + col) = v;
        }
    }
}

// The tiles of one launch: tile slots from moe_offsets (`tile_expert` etc.) or, with
// `tile_expert` null, the 128-row tiles of one dense matrix of `dense_rows` rows (expert 0);
// columns k read A's column k % a_cols (A rows a_cols apart); slice z of the k loop covers
// [z k_chunk, (z + 1) k_chunk) (dense mode only: it writes out[z], partial sums).
struct WsShape {
    const uint32_t *src, *tile_expert, *tile_start, *expert_end;
    int N, K, a_cols, row_tiles, dense_rows, k_chunk;
    // FP8 (E4M3 A and W) only: A's row scales and W's [E, N] column scales.
    const float *a_scale, *w_scale;
};

// The tile this CTA computes for work item `w` (w / n_tiles: a tile slot, w % n_tiles: the
// column tile). False: past the last tile — unused slots are at the end, and with tile slots
// there is one k slice (the host passes k_chunk = K), so every later work item is past it too.
template <int BN>
__device__ __forceinline__ bool ws_tile(int w, int n_tiles, const WsShape &g, uint32_t &e, int &row0, int &rows, int &n0) {
    const int slot = w / n_tiles;
    n0 = (w % n_tiles) * BN;
    if (!g.tile_expert) {
        e = 0;
        row0 = slot * WS_BM;
        rows = min(WS_BM, g.dense_rows - row0);
        return true;
    }
    e = g.tile_expert[slot];
    if (e == NONE) return false;
    row0 = (int)g.tile_start[slot];
    rows = min(WS_BM, (int)g.expert_end[e] - row0);
    return true;
}

template <typename T, typename O, Epilogue EPI, typename In = T>
__device__ void ws_gemm(O *__restrict__ out, const In *__restrict__ A, const TmaMap *wmap, const WsShape g) {
    [[maybe_unused]] constexpr bool FP8 = sizeof(In) == 1;
    [[maybe_unused]] constexpr int BKE = ROW_BYTES / sizeof(In), PER = 16 / sizeof(In); // columns a k tile, a 16-byte chunk
    [[maybe_unused]] constexpr int BN = ws_bn<In>(), B_BYTES = BN * ROW_BYTES, STAGE = WS_A_BYTES + B_BYTES;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char ws_smem[];
    // The swizzle is a function of the absolute address: stages start at a 1024-byte boundary
    // (the launch asks for 1 KB more), the consumers' epilogue buffers and the barriers after them.
    const unsigned smem = ((unsigned)__cvta_generic_to_shared(ws_smem) + 1023u) & ~1023u;
    const unsigned epi = smem + WS_STAGES * STAGE, full = epi + ws_epi_buffers<EPI>(), empty = full + WS_STAGES * 8;
    const int tid = threadIdx.x, wg = tid / 128;
    const int N = g.N, K = g.K;
    const int n_tiles = (N + BN - 1) / BN, slots = g.row_tiles;
    const int per_slice = slots * n_tiles, total = per_slice * ((K + g.k_chunk - 1) / g.k_chunk);
    // Work item w: slice w / per_slice, columns [k_begin, k_end) in k_tiles tiles.
    auto k_range = [&](int w, int &k_begin, int &k_end, int &k_tiles) {
        k_begin = (w / per_slice) * g.k_chunk;
        k_end = min(K, k_begin + g.k_chunk);
        k_tiles = (k_end - k_begin + BKE - 1) / BKE;
    };
    if (tid == 0) {
        for (int s = 0; s < WS_STAGES; ++s) {
            mbar_init(full + 8 * s, 129);
            mbar_init(empty + 8 * s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    uint32_t e;
    int row0, rows, n0;
    if (wg == 0) {
        // Producer: thread t loads 16-byte chunk t % 8 of A rows t / 8 + 16 i.
        const int kc = tid & 7;
        int it = 0;
        for (int w = blockIdx.x; w < total; w += gridDim.x) {
            if (!ws_tile<BN>(w % per_slice, n_tiles, g, e, row0, rows, n0)) break;
            int k_begin, k_end, k_tiles;
            k_range(w, k_begin, k_end, k_tiles);
            uint32_t a_row[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int r = tid / 8 + 16 * i;
                a_row[i] = r < rows ? (g.src ? g.src[row0 + r] : (uint32_t)(row0 + r)) : NONE;
            }
            const int w_row = (int)e * N + n0;
            for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                const int s = it % WS_STAGES;
                mbar_wait(empty + 8 * s, ((it / WS_STAGES) & 1) ^ 1);
                const unsigned stage = smem + s * STAGE;
                const int k0 = k_begin + kt * BKE;
                if (tid == 0) {
                    mbar_arrive_expect_tx(full + 8 * s, B_BYTES);
                    tma_load_2d(stage + WS_A_BYTES, wmap, k0, w_row, full + 8 * s);
                }
                const bool k_ok = k0 + kc * PER < k_end;
                const int ka = k0 % g.a_cols + kc * PER;
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const bool ok = k_ok && a_row[i] != NONE;
                    cp_async16(stage + tile_offset(tid / 8 + 16 * i, kc), ok ? A + (size_t)a_row[i] * g.a_cols + ka : A, ok);
                }
                cp_async_arrive(full + 8 * s);
            }
        }
        // Each stage's phase completes only once all its copies have arrived and the consumers
        // wait for every phase, so the CTA outlives the copies either way; this only drains what
        // the thread's scoreboard still tracks before it exits.
        cp_async_wait<0>();
    } else {
        // Consumers: warpgroup c = wg - 1 takes rows 64 c .. of the tile.
        const int c = wg - 1, warp = (tid / 32) % 4, lane = tid & 31;
        auto release = [&](int stage_it) {
            if (lane == 0) mbar_arrive(empty + 8 * (stage_it % WS_STAGES));
        };
        // acc: the tile's f32 sums. For FP8, `part` takes each k tile's MMAs from zero and is
        // added to acc on the CUDA cores: the FP8 tensor-core accumulator keeps about 14 bits of
        // its running sum (DeepSeek-V3 §3.3.2; 1.4 % relative error measured at k 2048 without
        // this), so a sum is promoted every 128 columns, as DeepSeek-V3 does. A tile's part must
        // be complete before it is added, so FP8 keeps no k tile's MMAs in flight across the
        // add; the other consumer warpgroup's MMAs fill the tensor cores meanwhile.
        float acc[BN / 2];
        [[maybe_unused]] float part[FP8 ? BN / 2 : 1];
        if constexpr (FP8) {
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) part[i] = 0.f;
        }
        int it = 0;
        for (int w = blockIdx.x; w < total; w += gridDim.x) {
            if (!ws_tile<BN>(w % per_slice, n_tiles, g, e, row0, rows, n0)) break;
            int k_begin, k_end, k_tiles;
            k_range(w, k_begin, k_end, k_tiles);
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
            const bool has_rows = c * 64 < rows;
            for (int kt = 0; kt < k_tiles; ++kt, ++it) {
                const int s = it % WS_STAGES;
                mbar_wait(full + 8 * s, (it / WS_STAGES) & 1);
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                const unsigned a_base = smem + s * STAGE + c * 64 * ROW_BYTES, b_base = smem + s * STAGE + WS_A_BYTES;
                // A warpgroup whose 64 rows are all past the tile's (an expert's last tile) issues
                // no MMAs but keeps step: it still waits for each stage and gives it back, else
                // its early arrivals on empty[s] would complete a phase the other still reads.
                if constexpr (FP8) {
                    if (has_rows) {
                        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                        for (int kk = 0; kk < ROW_BYTES / 32; ++kk)
                            wgmma_m64n128k32_e4m3(part, smem_desc(a_base + kk * 32), smem_desc(b_base + kk * 32), kk > 0);
                        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                        fence_operands<BN / 2>(part);
                    }
                    release(it);
                    if (has_rows) {
#pragma unroll
                        for (int i = 0; i < BN / 2; ++i) acc[i] += part[i];
                    }
                } else {
                    if (has_rows) {
                        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                        for (int kk = 0; kk < ROW_BYTES / 32; ++kk)
                            wgmma_m64n256k16<T>(acc, smem_desc(a_base + kk * 32), smem_desc(b_base + kk * 32));
                        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                    }
                    // The previous k tile's MMAs are done: its stage goes back to the producer.
                    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                    if (kt > 0) release(it - 1);
                }
            }
            if constexpr (!FP8) {
                asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
                fence_operands<BN / 2>(acc);
                release(it - 1);
            }
            if constexpr (FP8) {
                // The sums scaled back: acc[j * 4 + h * 2 + v] is row c·64 + warp·16 + lane/4 + 8h,
                // column n0 + 8j + 2(lane % 4) + v (rows and columns past the tile's are not stored).
                float sa[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = min(c * 64 + warp * 16 + (lane >> 2) + h * 8, rows - 1);
                    sa[h] = g.a_scale[g.src ? g.src[row0 + r] : (uint32_t)(row0 + r)];
                }
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int v = 0; v < 2; ++v) {
                        const float ws = g.w_scale[(size_t)e * N + min(n0 + j * 8 + (lane & 3) * 2 + v, N - 1)];
                        acc[j * 4 + v] *= sa[0] * ws;
                        acc[j * 4 + 2 + v] *= sa[1] * ws;
                    }
            }

            const int out_w = EPI == SWIGLU ? N / 2 : N;
            O *slice_out = out + (size_t)(w / per_slice) * (g.tile_expert ? 0 : g.dense_rows) * out_w;
            if constexpr (EPI == PLAIN) {
                ws_epilogue<T, BN>(slice_out, out_w, row0 + c * 64, rows - c * 64, n0, acc, epi + c * WS_EPI_BYTES, 1 + c);
            } else {
                // Accumulator v of n8 tile j (acc[j * 4 + v]) holds row lane / 4 (+ 8 for v >= 2) of
                // the warp's 16 rows, columns 2 * (lane % 4) + (v & 1) of the tile.
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = c * 64 + warp * 16 + (lane >> 2) + h * 8;
                    if (r >= rows) continue;
                    store_row<T, O, EPI, BN / 8>(slice_out + (size_t)(row0 + r) * out_w, n0, N, [&](int j, int v) { return acc[j * 4 + h * 2 + v]; });
                }
            }
        }
    }
#else
    __trap(); // launched only on sm_90 devices (the host checks), whose PTX target is sm_90a
#endif
}

// grid T, block ceil(H / 8) threads (each 8 columns); y [pairs, H] in sorted order.
template <typename T>
__device__ void moe_combine(T *__restrict__ out, const T *__restrict__ y, const float *__restrict__ weights,
                            const uint32_t *__restrict__ pos_of_pair, const T *__restrict__ shared,
                            const T *__restrict__ residual, int K, int H) {
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
    if (residual) {
        // The residual stream's add, after the cast as with a separate add.
        alignas(16) T r[8];
        *reinterpret_cast<uint4 *>(r) = *reinterpret_cast<const uint4 *>(residual + (size_t)t * H + c0);
#pragma unroll
        for (int c = 0; c < 8; ++c) o[c] = from_f<T>(to_f(r[c]) + to_f(o[c]));
    }
    *reinterpret_cast<uint4 *>(out + (size_t)t * H + c0) = *reinterpret_cast<uint4 *>(o);
}

} // namespace

extern "C" __global__ void moe_route(uint32_t *ids, float *weights, const float *logits, const float *bias, int tokens,
                                     int E, int K, int G, int KG, int softmax, int norm_topk, float scale) {
    route_tokens(ids, weights, logits, bias, tokens, E, K, G, KG, softmax, norm_topk, scale);
}

#define MOE_ROUTE_REG(PER)                                                                                     \
    extern "C" __global__ void moe_route_reg_p##PER(uint32_t *ids, float *weights, const float *logits,           \
                                                  const float *bias, int tokens, int E, int K, int G, int KG,      \
                                                  int softmax, int norm_topk, float scale) {                       \
        route_tokens_reg<PER>(ids, weights, logits, bias, tokens, E, K, G, KG, softmax, norm_topk, scale);         \
    }
MOE_ROUTE_REG(1)
MOE_ROUTE_REG(2)
MOE_ROUTE_REG(3)
MOE_ROUTE_REG(4)
MOE_ROUTE_REG(5)
MOE_ROUTE_REG(6)
MOE_ROUTE_REG(7)
MOE_ROUTE_REG(8)
#undef MOE_ROUTE_REG

extern "C" __global__ void moe_count(uint32_t *counts, const uint32_t *ids, int pairs, int E) {
    count_pairs(counts, ids, pairs, E);
}

extern "C" __global__ void moe_offsets(uint32_t *cursor, uint32_t *expert_end, uint32_t *tile_expert,
                                       uint32_t *tile_start, const uint32_t *counts, int E, int bm, int max_tiles) {
    expert_offsets(cursor, expert_end, tile_expert, tile_start, counts, E, bm, max_tiles);
}

extern "C" __global__ void moe_scatter(uint32_t *sorted_src, uint32_t *pos_of_pair, uint32_t *cursor,
                                       const uint32_t *ids, int pairs, int K, int E) {
    scatter_pairs(sorted_src, pos_of_pair, cursor, ids, pairs, K, E);
}

// moe_sum_slices: out[i] = sum over z of parts[z * n + i] in slice order (n a multiple of 4).
extern "C" __global__ void moe_sum_slices(float *out, const float *parts, int slices, long long n) {
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= n) return;
    float4 acc = *reinterpret_cast<const float4 *>(parts + i);
    for (int z = 1; z < slices; ++z) {
        const float4 p = *reinterpret_cast<const float4 *>(parts + (long long)z * n + i);
        acc.x += p.x;
        acc.y += p.y;
        acc.z += p.z;
        acc.w += p.w;
    }
    *reinterpret_cast<float4 *>(out + i) = acc;
}

#define GEMM_ARGS                                                                                              \
    const uint32_t *src, const uint32_t *te, const uint32_t *ts, const uint32_t *ee, int N, int K, int a_cols,     \
        int dense_rows
#define WS_ARGS                                                                                                \
    const uint32_t *src, const uint32_t *te, const uint32_t *ts, const uint32_t *ee, int N, int K, int a_cols,    \
        int row_tiles, int dense_rows, int k_chunk
#define WS_SHAPE WsShape{src, te, ts, ee, N, K, a_cols, row_tiles, dense_rows, k_chunk}
#define GEMM_PASS src, te, ts, ee, N, K, a_cols, dense_rows, K
#define MOE_OPS(T, SUF)                                                                                        \
    extern "C" __global__ void moe_gemm_swiglu_bm64_##SUF(T *out, const T *A, const T *W, GEMM_ARGS) {          \
        moe_gemm<T, T, 64, 32, SWIGLU>(out, A, W, GEMM_PASS);                                                       \
    }                                                                                                          \
    extern "C" __global__ void moe_gemm_swiglu_bm128_##SUF(T *out, const T *A, const T *W, GEMM_ARGS) {         \
        moe_gemm<T, T, 128, 64, SWIGLU>(out, A, W, GEMM_PASS);                                                      \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                             \
        moe_wgmma_swiglu_##SUF(T *out, const T *A, const __grid_constant__ TmaMap wmap, WS_ARGS) {               \
        ws_gemm<T, T, SWIGLU>(out, A, &wmap, WS_SHAPE);                                              \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                             \
        moe_wgmma_##SUF(T *out, const T *A, const __grid_constant__ TmaMap wmap, WS_ARGS) {                      \
        ws_gemm<T, T, PLAIN>(out, A, &wmap, WS_SHAPE);                                                \
    }                                                                                                          \
    extern "C" __global__ void moe_gemm_bm64_##SUF(T *out, const T *A, const T *W, GEMM_ARGS) {                 \
        moe_gemm<T, T, 64, 32, PLAIN>(out, A, W, GEMM_PASS);                                                        \
    }                                                                                                          \
    extern "C" __global__ void moe_gemm_bm128_##SUF(T *out, const T *A, const T *W, GEMM_ARGS) {                \
        moe_gemm<T, T, 128, 64, PLAIN>(out, A, W, GEMM_PASS);                                                       \
    }                                                                                                          \
    extern "C" __global__ void moe_combine_##SUF(T *out, const T *y, const float *w, const uint32_t *pos,        \
                                                 const T *shared, const T *residual, int K, int H) {            \
        moe_combine<T>(out, y, w, pos, shared, residual, K, H);                                                 \
    }

MOE_OPS(__nv_bfloat16, bf16)
MOE_OPS(__half, f16)

// W8A8 experts: A (the tokens' or the activations' rows) and W in E4M3 with their f32 scales,
// the output in T.
#define MOE_FP8_OPS(T, SUF)                                                                                    \
    extern "C" __global__ void moe_gemm_fp8_swiglu_bm64_##SUF(T *out, const uint8_t *A, const uint8_t *W,      \
                                                              GEMM_ARGS, const float *sa, const float *sw) {  \
        moe_gemm<T, T, 64, 32, SWIGLU, uint8_t>(out, A, W, GEMM_PASS, sa, sw);                                 \
    }                                                                                                          \
    extern "C" __global__ void moe_gemm_fp8_swiglu_bm128_##SUF(T *out, const uint8_t *A, const uint8_t *W,     \
                                                               GEMM_ARGS, const float *sa, const float *sw) { \
        moe_gemm<T, T, 128, 64, SWIGLU, uint8_t>(out, A, W, GEMM_PASS, sa, sw);                                \
    }                                                                                                          \
    extern "C" __global__ void moe_gemm_fp8_bm64_##SUF(T *out, const uint8_t *A, const uint8_t *W, GEMM_ARGS,  \
                                                       const float *sa, const float *sw) {                     \
        moe_gemm<T, T, 64, 32, PLAIN, uint8_t>(out, A, W, GEMM_PASS, sa, sw);                                  \
    }                                                                                                          \
    extern "C" __global__ void moe_gemm_fp8_bm128_##SUF(T *out, const uint8_t *A, const uint8_t *W, GEMM_ARGS, \
                                                        const float *sa, const float *sw) {                    \
        moe_gemm<T, T, 128, 64, PLAIN, uint8_t>(out, A, W, GEMM_PASS, sa, sw);                                 \
    }

MOE_FP8_OPS(__nv_bfloat16, bf16)
MOE_FP8_OPS(__half, f16)

// The same on Hopper's warpgroup MMA (FP8 wgmma: twice the 16-bit peak), at 128 x 128 tiles
// with each k tile's sums promoted to f32 (ws_gemm).
#define WS_FP8_SHAPE WsShape{src, te, ts, ee, N, K, a_cols, row_tiles, dense_rows, k_chunk, sa, sw}
#define MOE_WGMMA_FP8_OPS(T, SUF)                                                                              \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                             \
        moe_wgmma_fp8_swiglu_##SUF(T *out, const uint8_t *A, const __grid_constant__ TmaMap wmap, WS_ARGS,      \
                                   const float *sa, const float *sw) {                                         \
        ws_gemm<T, T, SWIGLU, uint8_t>(out, A, &wmap, WS_FP8_SHAPE);                                           \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)                                             \
        moe_wgmma_fp8_##SUF(T *out, const uint8_t *A, const __grid_constant__ TmaMap wmap, WS_ARGS,             \
                            const float *sa, const float *sw) {                                                \
        ws_gemm<T, T, PLAIN, uint8_t>(out, A, &wmap, WS_FP8_SHAPE);                                            \
    }

MOE_WGMMA_FP8_OPS(__nv_bfloat16, bf16)
MOE_WGMMA_FP8_OPS(__half, f16)

// The router's logits off Hopper: f32 partial sums per k slice of a bf16 activation (the router
// reads bf16 only).
extern "C" __global__ void moe_gemm_f32out_bm64_bf16(float *out, const __nv_bfloat16 *A, const __nv_bfloat16 *W,
                                                     GEMM_ARGS, int k_chunk) {
    moe_gemm<__nv_bfloat16, float, 64, 32, F32_OUT>(out, A, W, src, te, ts, ee, N, K, a_cols, dense_rows, k_chunk);
}

// The router's logits on the Hopper GEMM: dense, f32 partial sums per k slice (see moe_gemm_f32out_*).
extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
    moe_wgmma_f32out_bf16(float *out, const __nv_bfloat16 *A, const __grid_constant__ TmaMap wmap, WS_ARGS) {
    ws_gemm<__nv_bfloat16, float, F32_OUT>(out, A, &wmap, WS_SHAPE);
}
