// Paged attention over a block-table KV cache (ponder).
//
// Cache layout: [num_blocks, block_size, kv_heads, D]; queries packed [T, H, D] over rows with
// cu_q_lens. One thread block handles (row, kv head, tile of NQ "query items", key split), where a
// query item is one (query token, query head of this kv head's GQA group) pair, token-major. So a
// tile of K/V is read once per block (16-byte vector loads, in place through the block table) and
// used by all NQ items, held in registers.
//
// Inside a block, WARPS warps (NW, or 8 in the one-query `_w8` / `_w8o4` / `_w8k6` builds) take
// interleaved key tiles. A warp splits into KPW key groups of LPK lanes; each lane owns VEC = 16 / sizeof(T)
// consecutive elements of D. Scores are reduced over the LPK lanes with xor shuffles; each warp
// keeps an online softmax (base 2, f32) per item; warps are merged through shared memory at the
// end. With num_splits > 1 (few blocks, long
// contexts: decode), each block covers one key chunk and writes unnormalised partials (acc, max,
// sum) that paged_attn_combine_* merges.
//
// Key splits come in two plans (the host picks, see attention_split.rs): chunks of the host's
// bound on the context (chunk > 0; a captured graph's bound is its bucket, the next power of two),
// or, where those chunks would be long and uneven, chunks cut from the launch's actual longest
// context (chunk = 0): the grid's num_splits is then only the most any context of the bucket may
// use, every block derives the same split count from the rows' context lengths with split_count
// (below), and blocks past it find no keys and write empty partials.
//
// Rows are found without host data: block x of the grid belongs to row r when
// off(r) <= x < off(r + 1), off(r) = (cu_q[r] * group + r * (NQ - 1)) / NQ, which gives every row at
// least ceil(q_len * group / NQ) tiles (at most one idle tile per row).
//
// Masks: a row's queries sit at positions ctx - q_len + j. mask_block = 0: every query sees all ctx
// keys (bidirectional); mask_block = B > 0: a query at position p sees the keys before the end of
// its B-block, min(ctx, (p / B + 1) * B) — B = 1 is causal, B = block length is block-causal.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cp_async.cuh"
#include "mbarrier.cuh"

#define NW 4
#define NTHREADS (NW * 32)

namespace {

__device__ __forceinline__ int key_limit(int ctx, int q_len, int tok, int mask_block) {
    if (mask_block <= 0) return ctx;
    const int p = ctx - q_len + tok;
    return min(ctx, (p / mask_block + 1) * mask_block);
}

template <typename T> struct Cvt;

template <> struct Cvt<float> {
    static constexpr int VEC = 4;
    __device__ __forceinline__ static void to_float(const uint4 &raw, float *out) {
        out[0] = __uint_as_float(raw.x);
        out[1] = __uint_as_float(raw.y);
        out[2] = __uint_as_float(raw.z);
        out[3] = __uint_as_float(raw.w);
    }
    __device__ __forceinline__ static float from_float(float x) { return x; }
};

template <> struct Cvt<__nv_bfloat16> {
    static constexpr int VEC = 8;
    __device__ __forceinline__ static void to_float(const uint4 &raw, float *out) {
        const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 f = __bfloat1622float2(h[i]);
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    }
    __device__ __forceinline__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }
};

template <> struct Cvt<__half> {
    static constexpr int VEC = 8;
    __device__ __forceinline__ static void to_float(const uint4 &raw, float *out) {
        const __half2 *h = reinterpret_cast<const __half2 *>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float2 f = __half22float2(h[i]);
            out[2 * i] = f.x;
            out[2 * i + 1] = f.y;
        }
    }
    __device__ __forceinline__ static __half from_float(float x) { return __float2half(x); }
};

__device__ __forceinline__ uint4 ldg16(const void *p) {
    return __ldg(reinterpret_cast<const uint4 *>(p));
}

// Cache slot (block id * block_size + offset) of a row's key position p through its block table;
// bs_shift = log2(block_size) when it is a power of two, else -1.
__device__ __forceinline__ size_t cache_slot(const uint32_t *table, int p, int block_size, int bs_shift) {
    int blk_i, in_blk;
    if (bs_shift >= 0) {
        blk_i = p >> bs_shift;
        in_blk = p & (block_size - 1);
    } else {
        blk_i = p / block_size;
        in_blk = p - blk_i * block_size;
    }
    return (size_t)__ldg(table + blk_i) * block_size + in_blk;
}

// How many of at most max_splits key splits to cut a longest context of max_ctx keys into, for a
// grid of base_blocks blocks per split when wave_blocks blocks run at once: the launch lasts about
// (waves of blocks) x (keys a block walks + one step of fixed cost), so splitting pays until a
// further split adds a wave. Chunks are whole block steps of `step` keys. The host's copy
// (`split_count` in attention_split.rs) sizes the grid.
__device__ __forceinline__ int split_count(int max_ctx, int max_splits, int base_blocks, int wave_blocks, int step) {
    int best = 1;
    long long best_cost = -1;
    for (int s = 1; s <= max_splits; ++s) {
        const int chunk = ((max_ctx + s - 1) / s + step - 1) / step * step;
        if (s > 1 && (long long)chunk * (s - 1) >= max_ctx) break;  // the last split would be empty
        const long long waves = ((long long)base_blocks * s + wave_blocks - 1) / wave_blocks;
        const long long cost = waves * (chunk + step);
        if (best_cost < 0 || cost < best_cost) {
            best_cost = cost;
            best = s;
        }
    }
    return best;
}

// A decode launch with the new tokens' RoPE and K/V write folded in (the SIMT kernel's FRESH
// form, `paged_attn_rope_*`): q is then the fused projection [T, (H + 2 KVH) * D] (q_stride a
// row), every row has one query at its context's last position ctx - 1, rotated by cos_t / sin_t
// [T, D/2] here; the row's rotated k and its v go to slots[t] of kw / vw (skipped at or past
// num_slots: padding), and the block whose keys include position ctx - 1 takes them from shared
// memory instead of the cache. kw / vw alias the caches read through the read-only path: sound
// because no block reads a new token's slot from memory. Real rows each have their own slot; a
// graph's padding rows share one slot of the padding block at context 1, so their only key is
// their own fresh one (taken from shared memory) — their discarded outputs may differ from the
// two-launch path's, where the last writer of the shared slot wins.
template <typename T> struct Fresh {
    const T *cos_t;
    const T *sin_t;
    const uint32_t *slots;
    T *kw;
    T *vw;
    long long num_slots;
    int q_stride;
};

// One lane's VEC elements of a head under split-half RoPE, rounded to T: `own` holds elements
// [i * VEC, i * VEC + VEC), `partner` the same span D/2 away, c / s their angles; `first_half`
// when own is in the head's first half. Written as qkv_rope_write writes each pair, so the
// rotated values and the cache writes match its bit for bit (both folds use it; in the ring a
// lane's partner is 8 lanes away and comes by shuffle).
template <typename T>
__device__ __forceinline__ uint4 rope_vec(uint4 own, uint4 partner, uint4 c, uint4 sn, bool first_half) {
    constexpr int VEC = Cvt<T>::VEC;
    float xo[VEC], xp[VEC], cf[VEC], sf[VEC];
    Cvt<T>::to_float(own, xo);
    Cvt<T>::to_float(partner, xp);
    Cvt<T>::to_float(c, cf);
    Cvt<T>::to_float(sn, sf);
    __align__(16) T o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        const float x1 = first_half ? xo[e] : xp[e], x2 = first_half ? xp[e] : xo[e];
        o[e] = Cvt<T>::from_float(first_half ? x1 * cf[e] - x2 * sf[e] : x1 * sf[e] + x2 * cf[e]);
    }
    return *reinterpret_cast<const uint4 *>(o);
}

// Lane i's rotated VEC elements of the head at `head` (a row of the fused projection) for token
// row `t`'s angles.
template <typename T, int D>
__device__ __forceinline__ uint4 rope_lane(const T *head, const Fresh<T> &f, size_t t, int i) {
    constexpr int VEC = Cvt<T>::VEC;
    constexpr int HALF = D / 2 / VEC;  // lanes of a half head
    const bool first = i < HALF;
    const int j = first ? i : i - HALF;
    const T *c = f.cos_t + t * (D / 2) + j * VEC;
    const T *sn = f.sin_t + t * (D / 2) + j * VEC;
    return rope_vec<T>(ldg16(head + i * VEC), ldg16(head + (first ? i + HALF : j) * VEC), ldg16(c), ldg16(sn), first);
}

template <typename T, int D, int NQ, bool FRESH = false, int WARPS = NW, int KEY_SETS = 0>
__device__ __forceinline__ void paged_attn_impl(
    T *__restrict__ out,             // [T, H, D] (num_splits == 1)
    float *__restrict__ ws_acc,      // [splits, T, H, D] (num_splits > 1)
    float *__restrict__ ws_ml,       // [splits, T, H, 2]
    const T *__restrict__ q,         // [T, H, D]
    const T *__restrict__ kc,        // [blocks, bs, kvh, D]
    const T *__restrict__ vc,
    const uint32_t *__restrict__ block_tables, // [R, max_blocks]
    const uint32_t *__restrict__ context_lens, // [R]
    const uint32_t *__restrict__ cu_q,         // [R + 1]
    int num_rows, int max_blocks, int num_heads, int kv_heads, int block_size, int bs_shift,
    float scale_log2, int mask_block, int num_splits, int chunk, int wave_blocks, int num_tokens,
    const Fresh<T> fresh = Fresh<T>()) {
    constexpr int VEC = Cvt<T>::VEC;
    constexpr int ACTIVE = D / VEC;  // lanes holding data of one key
    constexpr int LPK = ACTIVE <= 4 ? 4 : ACTIVE <= 8 ? 8 : ACTIVE <= 16 ? 16 : 32;
    constexpr int KPW = 32 / LPK;    // keys a warp loads side by side
    constexpr int UNROLL = KEY_SETS > 0 ? KEY_SETS : NQ >= 8 ? 2 : 4;  // key sets a lane loads a step
    constexpr int KT = KPW * UNROLL; // keys per warp step
    static_assert(D % VEC == 0 && ACTIVE <= 32, "head dim");

    __shared__ int s_row;
    __shared__ int s_max_ctx[WARPS];
    __shared__ float s_acc[WARPS][NQ][D];
    __shared__ float s_m[WARPS][NQ];
    __shared__ float s_l[WARPS][NQ];
    __shared__ uint4 s_fresh[2][FRESH ? ACTIVE : 1];  // FRESH: the row's rotated new k, and its v

    const int group = num_heads / kv_heads;
    const int g = blockIdx.y;
    const int split = blockIdx.z;
    const long long bx = blockIdx.x;

    const bool derive_chunk = num_splits > 1 && chunk == 0;
    unsigned max_ctx = 0;
    for (int r = threadIdx.x; r < num_rows; r += WARPS * 32) {
        const long long o0 = ((long long)cu_q[r] * group + (long long)r * (NQ - 1)) / NQ;
        const long long o1 = ((long long)cu_q[r + 1] * group + (long long)(r + 1) * (NQ - 1)) / NQ;
        if (o0 <= bx && bx < o1) s_row = r;
        if (derive_chunk && o1 > o0) max_ctx = max(max_ctx, context_lens[r]);
    }
    if (derive_chunk) {
        max_ctx = __reduce_max_sync(0xffffffffu, max_ctx);
        if (threadIdx.x % 32 == 0) s_max_ctx[threadIdx.x / 32] = (int)max_ctx;
    }
    __syncthreads();
    const int r = s_row;
    const int q_start = cu_q[r];
    const int q_len = (int)cu_q[r + 1] - q_start;
    const long long off_r = ((long long)q_start * group + (long long)r * (NQ - 1)) / NQ;
    const int item0 = (int)(bx - off_r) * NQ;
    const int items = q_len * group;
    if (item0 >= items) return;  // block-uniform
    const int ctx = context_lens[r];

    if (derive_chunk) {
        constexpr int STEP = WARPS * KT;
        int longest = 0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) longest = max(longest, s_max_ctx[w]);
        const int base_blocks = (int)(gridDim.x * gridDim.y);
        const int splits = split_count(longest, num_splits, base_blocks, wave_blocks, STEP);
        chunk = ((longest + splits - 1) / splits + STEP - 1) / STEP * STEP;
    }
    const int last_tok = (min(item0 + NQ, items) - 1) / group;
    const int kend = key_limit(ctx, q_len, last_tok, mask_block);
    const int k0 = (int)min((long long)split * chunk, (long long)kend);
    const int k1 = (int)min((long long)kend, (long long)k0 + chunk);

    // FRESH: the row's new key and value, for the block that writes them to the cache (split 0)
    // and the block whose keys hold their position (block-uniform); loaded before the query so
    // that both are in flight together.
    const int p_new = FRESH ? ctx - 1 : -1;
    const bool fresh_block = FRESH && (split == 0 || (k0 <= p_new && p_new < k1));
    uint4 k_new = make_uint4(0, 0, 0, 0), v_new = make_uint4(0, 0, 0, 0);
    if (FRESH && fresh_block && (int)threadIdx.x < ACTIVE) {
        const T *row = q + (size_t)q_start * fresh.q_stride;
        k_new = rope_lane<T, D>(row + (size_t)(num_heads + g) * D, fresh, (size_t)q_start, threadIdx.x);
        v_new = ldg16(row + (size_t)(num_heads + kv_heads + g) * D + threadIdx.x * VEC);
    }

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int kl = lane % LPK;
    const int kg = lane / LPK;
    const bool active = kl < ACTIVE;

    float qv[NQ][VEC];
    int lim[NQ];
    float m[NQ], l[NQ], acc[NQ][VEC];
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
        const int item = item0 + n;
        const bool valid = item < items;
        const int tok = item / group;
        const int hg = item - tok * group;
        lim[n] = valid ? key_limit(ctx, q_len, tok, mask_block) : 0;
        if (valid && active) {
            if constexpr (FRESH) {
                const T *qh = q + (size_t)(q_start + tok) * fresh.q_stride + (size_t)(g * group + hg) * D;
                Cvt<T>::to_float(rope_lane<T, D>(qh, fresh, (size_t)(q_start + tok), kl), qv[n]);
            } else {
                const T *qp = q + ((size_t)(q_start + tok) * num_heads + (size_t)(g * group + hg)) * D + kl * VEC;
                Cvt<T>::to_float(ldg16(qp), qv[n]);
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) qv[n][e] *= scale_log2;
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) qv[n][e] = 0.f;
        }
        m[n] = -INFINITY;
        l[n] = 0.f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[n][e] = 0.f;
    }

    if (FRESH && fresh_block) {
        if ((int)threadIdx.x < ACTIVE) {
            s_fresh[0][threadIdx.x] = k_new;
            s_fresh[1][threadIdx.x] = v_new;
            const long long slot = (long long)fresh.slots[q_start];
            if (split == 0 && slot < fresh.num_slots) {
                const size_t at = (size_t)slot * kv_heads * D + (size_t)g * D + threadIdx.x * VEC;
                *reinterpret_cast<uint4 *>(fresh.kw + at) = k_new;
                *reinterpret_cast<uint4 *>(fresh.vw + at) = v_new;
            }
        }
        __syncthreads();
    }

    const uint32_t *table = block_tables + (size_t)r * max_blocks;
    const size_t slot_stride = (size_t)kv_heads * D;
    const size_t head_off = (size_t)g * D + kl * VEC;

    for (int base = k0 + warp * KT; base < k1; base += WARPS * KT) {
        uint4 kraw[UNROLL], vraw[UNROLL];
        int pos[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int p = base + u * KPW + kg;
            pos[u] = p;
            if (FRESH && p == p_new && p < k1 && active) {
                kraw[u] = s_fresh[0][kl];
                vraw[u] = s_fresh[1][kl];
            } else if (p < k1 && active) {
                const size_t idx = cache_slot(table, p, block_size, bs_shift) * slot_stride + head_off;
                kraw[u] = ldg16(kc + idx);
                vraw[u] = ldg16(vc + idx);
            } else {
                kraw[u] = make_uint4(0, 0, 0, 0);
                vraw[u] = make_uint4(0, 0, 0, 0);
            }
        }
        float kf[UNROLL][VEC], vf[UNROLL][VEC];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            Cvt<T>::to_float(kraw[u], kf[u]);
            Cvt<T>::to_float(vraw[u], vf[u]);
        }
#pragma unroll
        for (int n = 0; n < NQ; ++n) {
            float s[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < VEC; ++e) d = fmaf(qv[n][e], kf[u][e], d);
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                s[u] = (pos[u] < k1 && pos[u] < lim[n]) ? d : -INFINITY;
            }
            float tmax = s[0];
#pragma unroll
            for (int u = 1; u < UNROLL; ++u) tmax = fmaxf(tmax, s[u]);
#pragma unroll
            for (int o = LPK; o < 32; o <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
            const float mnew = fmaxf(m[n], tmax);
            if (mnew == -INFINITY) continue;  // warp-uniform: nothing visible yet
            const float alpha = exp2f(m[n] - mnew);
            m[n] = mnew;
            l[n] *= alpha;
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[n][e] *= alpha;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const float pr = exp2f(s[u] - mnew);
                l[n] += pr;
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[n][e] = fmaf(pr, vf[u][e], acc[n][e]);
            }
        }
    }

    // Merge the key groups of the warp (they share m).
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
#pragma unroll
        for (int o = LPK; o < 32; o <<= 1) {
            l[n] += __shfl_xor_sync(0xffffffffu, l[n], o);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[n][e] += __shfl_xor_sync(0xffffffffu, acc[n][e], o);
        }
        if (kg == 0 && active) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) s_acc[warp][n][kl * VEC + e] = acc[n][e];
        }
        if (lane == 0) {
            s_m[warp][n] = m[n];
            s_l[warp][n] = l[n];
        }
    }
    __syncthreads();

    // Merge the warps and write.
    for (int idx = threadIdx.x; idx < NQ * D; idx += WARPS * 32) {
        const int n = idx / D;
        const int e = idx - n * D;
        const int item = item0 + n;
        if (item >= items) continue;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, s_m[w][n]);
        float L = 0.f, A = 0.f;
        if (M != -INFINITY) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = exp2f(s_m[w][n] - M);
                L += s_l[w][n] * f;
                A += s_acc[w][n][e] * f;
            }
        }
        const int tok = item / group;
        const int hg = item - tok * group;
        const size_t th = (size_t)(q_start + tok) * num_heads + (size_t)(g * group + hg);
        if (num_splits == 1) {
            out[th * D + e] = Cvt<T>::from_float(L > 0.f ? A / L : 0.f);
        } else {
            const size_t sth = (size_t)split * num_tokens * num_heads + th;
            if (L > 0.f) ws_acc[sth * D + e] = A;  // the combine reads no acc of an empty split
            if (e == 0) {
                ws_ml[sth * 2] = M;
                ws_ml[sth * 2 + 1] = L;
            }
        }
    }
}

// Merges n partials of one (token, head) — acc at acc + s x stride x D, (max, sum) at
// ml + s x stride x 2 — into o[0..D): split launches of both decode kernels end here.
template <typename T, int D>
__device__ __forceinline__ void merge_partials(T *__restrict__ o, const float *__restrict__ acc,
                                               const float *__restrict__ ml, int n, size_t stride) {
    float M = -INFINITY;
    for (int s = 0; s < n; ++s) M = fmaxf(M, ml[s * stride * 2]);
    for (int e = threadIdx.x; e < D; e += blockDim.x) {
        float L = 0.f, A = 0.f;
        if (M != -INFINITY) {
            for (int s = 0; s < n; ++s) {
                const float ls = ml[s * stride * 2 + 1];
                if (ls > 0.f) {
                    const float f = exp2f(ml[s * stride * 2] - M);
                    L += ls * f;
                    A += acc[s * stride * D + e] * f;
                }
            }
        }
        o[e] = Cvt<T>::from_float(L > 0.f ? A / L : 0.f);
    }
}

template <typename T, int D>
__device__ __forceinline__ void combine_impl(T *__restrict__ out, const float *__restrict__ ws_acc,
                                             const float *__restrict__ ws_ml, int num_splits,
                                             int num_tokens, int num_heads) {
    const size_t th = (size_t)blockIdx.x * num_heads + blockIdx.y;
    merge_partials<T, D>(out + th * D, ws_acc + th * D, ws_ml + th * 2, num_splits, (size_t)num_tokens * num_heads);
}


// ---------------------------------------------------------------------------------------------
// Tensor-core variant for many query items per (row, kv head) (prefill, diffusion blocks):
// bf16/f16 only. A block of 4 warps takes 64 query items (16 per warp, the M of
// mma.m16n8k16); K/V tiles of 32 keys are staged in shared memory, S = Q K^T and O += P V run on
// mma.sync with f32 accumulators, the online softmax runs on the accumulator fragments.
// PIPE = true (paged_attn_mma_pipe_*): two shared-memory stages filled by cp.async, so the next
// tile's loads are in flight while this one is computed, and K / V fragments come from ldmatrix
// (V transposed by ldmatrix.trans) instead of one 32- or 16-bit shared load per element pair.
// ---------------------------------------------------------------------------------------------

template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
    __device__ __forceinline__ static void run(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
};
template <> struct Mma<__half> {
    __device__ __forceinline__ static void run(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
};

#define MMA_NQ 64
#define MMA_KB 32
// Blocks per SM the register allocation must allow: the kernel is latency-bound (S, softmax and
// PV of one 32-key tile per barrier), and at its free allocation (176 registers on the H200)
// only two blocks fit. Three (a few spilled registers) measured fastest on the H200; four spill
// more and give back half the gain.
#define MMA_MIN_BLOCKS 3

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane t gives the address of row t % 8 of matrix t / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t *r, const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t *r, const void *row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

template <typename T, int D, bool PIPE>
__device__ __forceinline__ void paged_attn_mma_impl(
    T *__restrict__ out, const T *__restrict__ q, const T *__restrict__ kc, const T *__restrict__ vc,
    const uint32_t *__restrict__ block_tables, const uint32_t *__restrict__ context_lens,
    const uint32_t *__restrict__ cu_q, int num_rows, int max_blocks, int num_heads, int kv_heads,
    int block_size, int bs_shift, float scale_log2, int mask_block) {
    constexpr int LD = D + 8;        // smem row stride (elements): conflict-free fragment reads
    constexpr int KS = D / 16;       // k-steps of S = Q K^T
    constexpr int NT = D / 8;        // n-tiles of O
    constexpr int CH = D / 8;        // 16-byte chunks per key row
    constexpr int STAGES = PIPE ? 2 : 1;
    static_assert(!PIPE || KS % 2 == 0, "ldmatrix.x4 takes two k-steps of K at once");
    __shared__ __align__(16) T s_k[STAGES][MMA_KB * LD];
    __shared__ __align__(16) T s_v[STAGES][MMA_KB * LD];
    __shared__ int s_row;

    const int group = num_heads / kv_heads;
    const int g = blockIdx.y;
    const long long bx = blockIdx.x;
    for (int r = threadIdx.x; r < num_rows; r += NTHREADS) {
        const long long o0 = ((long long)cu_q[r] * group + (long long)r * (MMA_NQ - 1)) / MMA_NQ;
        const long long o1 = ((long long)cu_q[r + 1] * group + (long long)(r + 1) * (MMA_NQ - 1)) / MMA_NQ;
        if (o0 <= bx && bx < o1) s_row = r;
    }
    __syncthreads();
    const int r = s_row;
    const int q_start = cu_q[r];
    const int q_len = (int)cu_q[r + 1] - q_start;
    const long long off_r = ((long long)q_start * group + (long long)r * (MMA_NQ - 1)) / MMA_NQ;
    const int item0 = (int)(bx - off_r) * MMA_NQ;
    const int items = q_len * group;
    if (item0 >= items) return;  // block-uniform
    const int ctx = context_lens[r];
    const int last_tok = (min(item0 + MMA_NQ, items) - 1) / group;
    const int k1 = key_limit(ctx, q_len, last_tok, mask_block);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane >> 2, tig = lane & 3;
    // The two query rows of this lane: gid and gid + 8 of the warp's 16.
    int lim[2];
    const T *qp[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int item = item0 + warp * 16 + gid + h * 8;
        const bool valid = item < items;
        const int tok = item / group;
        const int hg = item - tok * group;
        lim[h] = valid ? key_limit(ctx, q_len, tok, mask_block) : 0;
        qp[h] = valid ? q + ((size_t)(q_start + tok) * num_heads + (size_t)(g * group + hg)) * D : nullptr;
    }
    uint32_t qa[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
        const int d = ks * 16 + tig * 2;
        qa[ks][0] = qp[0] ? *reinterpret_cast<const uint32_t *>(qp[0] + d) : 0u;
        qa[ks][1] = qp[1] ? *reinterpret_cast<const uint32_t *>(qp[1] + d) : 0u;
        qa[ks][2] = qp[0] ? *reinterpret_cast<const uint32_t *>(qp[0] + d + 8) : 0u;
        qa[ks][3] = qp[1] ? *reinterpret_cast<const uint32_t *>(qp[1] + d + 8) : 0u;
    }
    float o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    const uint32_t *table = block_tables + (size_t)r * max_blocks;
    const size_t slot_stride = (size_t)kv_heads * D;
    // Flat cache index of key p's first element for this kv head.
    auto key_index = [&](int p) -> size_t { return cache_slot(table, p, block_size, bs_shift) * slot_stride + (size_t)g * D; };
    // PIPE: start copying the tile of keys from `from` into stage `st` (zeros past k1).
    auto issue_tile = [&](int from, int st) {
        for (int c = threadIdx.x; c < MMA_KB * CH; c += NTHREADS) {
            const int key = c / CH, part = c - key * CH;
            const int p = from + key;
            const bool in = p < k1;
            const size_t idx = in ? key_index(p) + part * 8 : 0;
            cp_async16(smem_addr(&s_k[st][key * LD + part * 8]), kc + idx, in);
            cp_async16(smem_addr(&s_v[st][key * LD + part * 8]), vc + idx, in);
        }
        cp_async_commit();
    };
    if constexpr (PIPE) issue_tile(0, 0);
    int stage = 0;
    for (int base = 0; base < k1; base += MMA_KB) {
        if constexpr (PIPE) {
            // The other stage was last read by the previous tile, finished at its trailing barrier.
            if (base + MMA_KB < k1) {
                issue_tile(base + MMA_KB, stage ^ 1);
                cp_async_wait<1>();  // this tile landed; the next may still be in flight
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
        } else {
            __syncthreads();  // previous tile consumed
            for (int c = threadIdx.x; c < MMA_KB * CH; c += NTHREADS) {
                const int key = c / CH, part = c - key * CH;
                const int p = base + key;
                uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
                if (p < k1) {
                    const size_t idx = key_index(p) + part * 8;
                    kv4 = ldg16(kc + idx);
                    vv4 = ldg16(vc + idx);
                }
                *reinterpret_cast<uint4 *>(&s_k[0][key * LD + part * 8]) = kv4;
                *reinterpret_cast<uint4 *>(&s_v[0][key * LD + part * 8]) = vv4;
            }
            __syncthreads();
        }
        const T *sk = s_k[stage];
        const T *sv = s_v[stage];
        // S = Q K^T for 32 keys: 4 n-tiles of 8 keys.
        float s[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            if constexpr (PIPE) {
                // Matrix m of ldmatrix.x4: keys j*8.., dims ks*16 + m*8 (m = 0, 1) and (ks+1)*16 + (m-2)*8.
                const T *krow = &sk[(j * 8 + (lane & 7)) * LD + (lane >> 3) * 8];
#pragma unroll
                for (int ks = 0; ks < KS; ks += 2) {
                    uint32_t b[4];
                    ldmatrix_x4(b, krow + ks * 16);
                    Mma<T>::run(s[j], qa[ks], b[0], b[1]);
                    Mma<T>::run(s[j], qa[ks + 1], b[2], b[3]);
                }
            } else {
                const T *krow = &sk[(j * 8 + gid) * LD + tig * 2];
#pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
                    const uint32_t b0 = *reinterpret_cast<const uint32_t *>(krow + ks * 16);
                    const uint32_t b1 = *reinterpret_cast<const uint32_t *>(krow + ks * 16 + 8);
                    Mma<T>::run(s[j], qa[ks], b0, b1);
                }
            }
        }
        // Mask, scale, online softmax (rows gid -> h = 0, gid + 8 -> h = 1).
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e >> 1;
                const int p = base + j * 8 + tig * 2 + (e & 1);
                const float v = (p < k1 && p < lim[h]) ? s[j][e] * scale_log2 : -INFINITY;
                s[j][e] = v;
                mx[h] = fmaxf(mx[h], v);
            }
        }
        float alpha[2], mu[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float mnew = fmaxf(m[h], mx[h]);
            mu[h] = mnew == -INFINITY ? 0.f : mnew;
            alpha[h] = exp2f(m[h] - mu[h]);
            m[h] = mnew;
            l[h] *= alpha[h];
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            o[nt][0] *= alpha[0];
            o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1];
            o[nt][3] *= alpha[1];
        }
        uint32_t pa[2][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float pe[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                pe[e] = exp2f(s[j][e] - mu[e >> 1]);
                l[e >> 1] += pe[e];
            }
            pa[j >> 1][(j & 1) * 2 + 0] = Mma<T>::pack(pe[0], pe[1]);
            pa[j >> 1][(j & 1) * 2 + 1] = Mma<T>::pack(pe[2], pe[3]);
        }
        // O += P V: 2 k-steps of 16 keys, NT n-tiles of 8 dims.
        if constexpr (PIPE) {
            // ldmatrix.x4.trans: matrix m holds keys m*8.. of dims nt*8..; lane t addresses key t.
            const T *vrow = &sv[lane * LD];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                uint32_t b[4];
                ldmatrix_x4_trans(b, vrow + nt * 8);
                Mma<T>::run(o[nt], pa[0], b[0], b[1]);
                Mma<T>::run(o[nt], pa[1], b[2], b[3]);
            }
            __syncthreads();  // every warp is done with this stage before it is refilled
            stage ^= 1;
        } else {
            const unsigned short *vs = reinterpret_cast<const unsigned short *>(sv);
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const int k0 = t * 16 + tig * 2;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int d = nt * 8 + gid;
                    const uint32_t b0 = (uint32_t)vs[k0 * LD + d] | ((uint32_t)vs[(k0 + 1) * LD + d] << 16);
                    const uint32_t b1 = (uint32_t)vs[(k0 + 8) * LD + d] | ((uint32_t)vs[(k0 + 9) * LD + d] << 16);
                    Mma<T>::run(o[nt], pa[t], b0, b1);
                }
            }
        }
    }
    if constexpr (PIPE) cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int item = item0 + warp * 16 + gid + h * 8;
        if (item >= items) continue;
        const int tok = item / group;
        const int hg = item - tok * group;
        T *op = out + ((size_t)(q_start + tok) * num_heads + (size_t)(g * group + hg)) * D;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            *reinterpret_cast<uint32_t *>(op + nt * 8 + tig * 2) =
                Mma<T>::pack(o[nt][h * 2] * inv, o[nt][h * 2 + 1] * inv);
        }
    }
}
}  // namespace

#define PA_ARGS(T)                                                                               \
    T *out, float *ws_acc, float *ws_ml, const T *q, const T *kc, const T *vc,                   \
        const uint32_t *block_tables, const uint32_t *context_lens, const uint32_t *cu_q,        \
        int num_rows, int max_blocks, int num_heads, int kv_heads, int block_size, int bs_shift, \
        float scale_log2, int mask_block, int num_splits, int chunk, int wave_blocks, int num_tokens

#define PA_PASS                                                                                  \
    out, ws_acc, ws_ml, q, kc, vc, block_tables, context_lens, cu_q, num_rows, max_blocks,       \
        num_heads, kv_heads, block_size, bs_shift, scale_log2, mask_block, num_splits, chunk,    \
        wave_blocks, num_tokens

// The multi-query kernels (several query items a row and kv head: GQA groups, prefill).
#define PA_KERNEL(NAME, T, D, NQ)                                                                \
    extern "C" __global__ void __launch_bounds__(NTHREADS)                                      \
        paged_attn_##NAME##_d##D##_q##NQ(PA_ARGS(T)) {                                          \
        paged_attn_impl<T, D, NQ>(PA_PASS);                                                      \
    }

// The one-query kernels (a looped decode step) come in five builds, each a name suffix, launch
// bounds, warps a block and key sets a lane (0: the kernel's default):
// - `_q1`: 4 warps, the free allocation.
// - `_o7`: held to 7 blocks an SM (72 registers on the H200 instead of 80 for 6, no spills): more
//   warps waiting on K/V hide latency when each block walks few keys; with many, the free
//   allocation keeps more loads in flight per warp.
// - `_w8`: 8 warps, at least 3 blocks an SM: a decode launch of one wave of (row, kv head) blocks
//   walks each row's keys unsplit in one block, with no combine launch.
// - `_w8o4`: the same held to 4 blocks an SM (64 registers: a few spill), for one-wave launches
//   of up to four blocks an SM (32 rows of 16 heads on the H200).
// - `_w8k6`: 8 warps of 6 key sets a lane, held to 2 blocks an SM: a launch of at most one
//   (row, kv head) block an SM walks each row's keys unsplit with more K/V loads in flight a warp.
// attention_split.rs says which runs when. BUILD makes one kernel of a build: plain, or with
// qkv_rope_write folded in.
#define W8_WARPS 8
#define W8K6_KEY_SETS 6
#define PA_Q1_BUILDS(BUILD, NAME, T, D)                                                          \
    BUILD(NAME, T, D, , __launch_bounds__(NTHREADS), NW, 0)                                      \
    BUILD(NAME, T, D, _o7, __launch_bounds__(NTHREADS, 7), NW, 0)                                \
    BUILD(NAME, T, D, _w8, __launch_bounds__(W8_WARPS * 32, 3), W8_WARPS, 0)                     \
    BUILD(NAME, T, D, _w8o4, __launch_bounds__(W8_WARPS * 32, 4), W8_WARPS, 0)                   \
    BUILD(NAME, T, D, _w8k6, __launch_bounds__(W8_WARPS * 32, 2), W8_WARPS, W8K6_KEY_SETS)

#define PA_Q1_PLAIN(NAME, T, D, SUF, BOUNDS, WARPS, KEY_SETS)                                    \
    extern "C" __global__ void BOUNDS paged_attn_##NAME##_d##D##_q1##SUF(PA_ARGS(T)) {           \
        paged_attn_impl<T, D, 1, false, WARPS, KEY_SETS>(PA_PASS);                               \
    }

// With qkv_rope_write folded in (FRESH, decode launches of MHA models: one query item a row and
// kv head); `q` is then the fused projection.
#define PA_ROPE_ARGS(T)                                                                          \
    PA_ARGS(T), const T *cos_t, const T *sin_t, const uint32_t *slots, T *kw, T *vw,             \
        long long num_slots, int q_stride
#define PA_FRESH(T) Fresh<T>{cos_t, sin_t, slots, kw, vw, num_slots, q_stride}
#define PA_Q1_ROPE(NAME, T, D, SUF, BOUNDS, WARPS, KEY_SETS)                                     \
    extern "C" __global__ void BOUNDS paged_attn_rope_##NAME##_d##D##_q1##SUF(PA_ROPE_ARGS(T)) { \
        paged_attn_impl<T, D, 1, true, WARPS, KEY_SETS>(PA_PASS, PA_FRESH(T));                   \
    }

#define PA_KERNELS_D(NAME, T, D)                                                                 \
    PA_Q1_BUILDS(PA_Q1_PLAIN, NAME, T, D)                                                        \
    PA_KERNEL(NAME, T, D, 2)                                                                     \
    PA_KERNEL(NAME, T, D, 4)                                                                     \
    PA_KERNEL(NAME, T, D, 8)                                                                     \
    extern "C" __global__ void paged_attn_combine_##NAME##_d##D(                                \
        T *out, const float *ws_acc, const float *ws_ml, int num_splits, int num_tokens,         \
        int num_heads) {                                                                         \
        combine_impl<T, D>(out, ws_acc, ws_ml, num_splits, num_tokens, num_heads);               \
    }

#define PA_KERNELS(NAME, T)                                                                      \
    PA_KERNELS_D(NAME, T, 64)                                                                    \
    PA_KERNELS_D(NAME, T, 96)                                                                    \
    PA_KERNELS_D(NAME, T, 128)

PA_KERNELS(f32, float)
PA_KERNELS(bf16, __nv_bfloat16)
PA_KERNELS(f16, __half)
#define PA_ROPE_KERNELS_ALL(NAME, T)                                                             \
    PA_Q1_BUILDS(PA_Q1_ROPE, NAME, T, 64)                                                        \
    PA_Q1_BUILDS(PA_Q1_ROPE, NAME, T, 96)                                                        \
    PA_Q1_BUILDS(PA_Q1_ROPE, NAME, T, 128)

PA_ROPE_KERNELS_ALL(bf16, __nv_bfloat16)
PA_ROPE_KERNELS_ALL(f16, __half)

#define PA_MMA_KERNEL(NAME, T, D)                                                                \
    PA_MMA_KERNEL_AS(paged_attn_mma_##NAME##_d##D, T, D, false)                                   \
    PA_MMA_KERNEL_AS(paged_attn_mma_pipe_##NAME##_d##D, T, D, true)

#define PA_MMA_KERNEL_AS(FN, T, D, PIPE)                                                         \
    extern "C" __global__ void __launch_bounds__(NTHREADS, MMA_MIN_BLOCKS) FN(                   \
        T *out, const T *q, const T *kc, const T *vc, const uint32_t *block_tables,              \
        const uint32_t *context_lens, const uint32_t *cu_q, int num_rows, int max_blocks,        \
        int num_heads, int kv_heads, int block_size, int bs_shift, float scale_log2,             \
        int mask_block) {                                                                            \
        paged_attn_mma_impl<T, D, PIPE>(out, q, kc, vc, block_tables, context_lens, cu_q,        \
                                  num_rows,                                                      \
                                  max_blocks, num_heads, kv_heads, block_size, bs_shift,         \
                                  scale_log2, mask_block);                                           \
    }

PA_MMA_KERNEL(bf16, __nv_bfloat16, 64)
PA_MMA_KERNEL(bf16, __nv_bfloat16, 96)
PA_MMA_KERNEL(bf16, __nv_bfloat16, 128)
PA_MMA_KERNEL(f16, __half, 64)
PA_MMA_KERNEL(f16, __half, 96)
PA_MMA_KERNEL(f16, __half, 128)

// ---------------------------------------------------------------------------------------------
// Decode through a ring of bulk copies (sm_90+; one query a row, head dim 128). The cache is
// [block, position, kv head, D], so the K (or V) of RING_CP consecutive positions of a page is one
// contiguous run of RING_CP x kv_heads x 256 bytes — a stage. A producer warp copies K and V of a
// stage with two cp.async.bulk into a ring of `depth` shared-memory stages (an mbarrier counts the
// bytes in); the consumer warps — two query heads each, 16 lanes a head, 8 elements a lane — read
// every stage, score, keep an online softmax (base 2, as the SIMT kernel) and accumulate V, then
// release the stage (an mbarrier of one arrival a consumer warp). The copies run ahead of the
// softmax by the ring's depth, so a block keeps up to depth x 2 x RING_CP positions in flight
// without registers.
//
// Work is balanced over a fixed grid: the launch's stages, rows laid end to end, are cut into
// gridDim.x equal runs (at least min_chunk stages), one a block. A block's run may end inside a
// row and go on into the next ones; the ring keeps streaming across those row boundaries, and the
// consumers write a partial (or, for a row the run holds whole, the output) at each. The unit of
// work is a row's every head (16x coarser than the SIMT kernel's row x head), so one split count
// for every row lost whenever contexts varied; the equal runs make the launch as
// long as its total keys, whatever their spread. Partial (row r, block b) goes to slot b + r —
// unique, since walking the stages in order raises b or r at every boundary. A row cut between
// blocks is split by the block holding its first stage, and at most one a block (the row its run
// ends in): that block records the row, its first slot and count for paged_decode_ring_combine.
#define RING_CP 4
#define RING_MAX_DEPTH 4
#define RING_D 128
namespace {

__device__ __forceinline__ unsigned long long ring_stages(uint32_t ctx) {
    return ((unsigned long long)ctx + RING_CP - 1) / RING_CP;
}

// Exclusive prefix of `v` over the block's threads; `total` gets the block's sum. Every thread of
// the block calls it (it synchronises); `warp_sums` holds a value per warp.
__device__ __forceinline__ unsigned long long ring_block_scan(unsigned long long v, unsigned long long *warp_sums,
                                                              unsigned long long &total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    unsigned long long x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    unsigned long long before = 0, all = 0;
    for (int w = 0; w < warps; ++w) {
        const unsigned long long s = warp_sums[w];
        if (w < warp) before += s;
        all += s;
    }
    __syncthreads();  // warp_sums is written again by the next call
    total = all;
    return before + x - v;
}

// The scaled score of one key for a consumer lane's head: q . k over the lane's 8 elements, summed
// over the head's 16 lanes.
template <typename T>
__device__ __forceinline__ float ring_score(const float (&qv)[8], uint4 k) {
    float kf[8];
    Cvt<T>::to_float(k, kf);
    float d = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) d = fmaf(qv[e], kf[e], d);
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
    return d;
}

// One stage of the ring for a consumer lane (8 elements of one head; 16 lanes a head): the K and V
// of the stage's `cnt` positions read out of shared memory, the stage released (one arrival a
// warp on `empty_bar`), then scores, the online softmax (base 2) and the V accumulation. FULL
// (cnt == RING_CP: every stage but a row's last, partly filled one) drops the per-position guards,
// which were about a seventh of the loop's instructions; both forms do the same arithmetic.
template <typename T, bool FULL>
__device__ __forceinline__ void ring_stage(const T *ks, int pos_elems, int off, int cnt, const float (&qv)[8],
                                           float &m, float &l, float (&acc)[8], uint32_t empty_bar, int lane) {
    const T *vs = ks + RING_CP * pos_elems;
    uint4 kr[RING_CP], vr[RING_CP];
#pragma unroll
    for (int k = 0; k < RING_CP; ++k) {
        const bool ok = FULL || k < cnt;
        kr[k] = ok ? *reinterpret_cast<const uint4 *>(ks + k * pos_elems + off) : make_uint4(0, 0, 0, 0);
        vr[k] = ok ? *reinterpret_cast<const uint4 *>(vs + k * pos_elems + off) : make_uint4(0, 0, 0, 0);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty_bar);
    float sc[RING_CP];
#pragma unroll
    for (int k = 0; k < RING_CP; ++k) {
        const float d = ring_score<T>(qv, kr[k]);
        sc[k] = FULL || k < cnt ? d : -INFINITY;
    }
    float mx = m;
#pragma unroll
    for (int k = 0; k < RING_CP; ++k) mx = fmaxf(mx, sc[k]);
    if (mx == -INFINITY) return;  // nothing finite yet (NaN scores): as the SIMT kernel
    const float alpha = exp2f(m - mx);  // m = -inf gives 0
    m = mx;
    l *= alpha;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= alpha;
#pragma unroll
    for (int k = 0; k < RING_CP; ++k) {
        if (FULL || k < cnt) {
            const float pr = exp2f(sc[k] - mx);
            l += pr;
            float vf[8];
            Cvt<T>::to_float(vr[k], vf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = fmaf(pr, vf[e], acc[e]);
        }
    }
}

// The ring with qkv_rope_write's work folded in (ROPE): q comes rotated out of the fused QKV
// projection `qkv` [T, (H + 2 KVH) D] with `cos_t` / `sin_t` [T, D/2] (split-half RoPE), and each
// row's newest key and value (its token's) are taken from `qkv` in registers — attended to after
// the row's last stage, which then holds only the older positions — and written into the caches
// at `slots[token]` for later steps (a slot past `num_slots` is not written).
template <typename T> struct RingRope {
    const T *qkv = nullptr, *cos_t = nullptr, *sin_t = nullptr;
    const uint32_t *slots = nullptr;
    T *k_cache = nullptr, *v_cache = nullptr;
    long long num_slots = 0;
};

__device__ __forceinline__ uint4 shfl_xor4(uint4 v, int mask) {
    return make_uint4(__shfl_xor_sync(0xffffffffu, v.x, mask), __shfl_xor_sync(0xffffffffu, v.y, mask),
                      __shfl_xor_sync(0xffffffffu, v.z, mask), __shfl_xor_sync(0xffffffffu, v.w, mask));
}

// Block: (ceil(num_heads / 2) + 1) warps, the last the producer; any grid; dynamic shared memory
// depth x 2 x RING_CP x kv_heads x RING_D x sizeof(T). Every row has one query (token cu_q[r]) and
// sees its whole context; block_size is a multiple of RING_CP. Workspace: partials `ws_acc`
// [gridDim.x + num_rows, num_heads, D] and `ws_ml` [.., num_heads, 2]; `ws_own` [gridDim.x]: the
// row this block split (row, first slot, count; row -1 if none).
template <typename T, bool ROPE = false>
__device__ __forceinline__ void paged_decode_ring_impl(
    T *__restrict__ out, float *__restrict__ ws_acc, float *__restrict__ ws_ml, int4 *__restrict__ ws_own,
    const T *__restrict__ q, const T *__restrict__ kc, const T *__restrict__ vc,
    const uint32_t *__restrict__ block_tables, const uint32_t *__restrict__ context_lens,
    const uint32_t *__restrict__ cu_q, int num_rows, int max_blocks, int num_heads, int kv_heads,
    int block_size, float scale_log2, int depth, int min_chunk, const RingRope<T> rope = RingRope<T>()) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char ring_smem[];
    __shared__ __align__(8) uint64_t full[RING_MAX_DEPTH], empty[RING_MAX_DEPTH];
    __shared__ unsigned long long warp_sums[32], s_first_start;
    __shared__ int s_first_row;
    const int cwarps = (int)(blockDim.x / 32) - 1;
    if (cwarps < 1 || depth < 1 || depth > RING_MAX_DEPTH) return;  // block-uniform; the host never asks it
    // The launch's stages and this block's run [g0, g1) of them. Up to a row a thread (every
    // decode width measured) one scan gives both the total and each row's start; beyond, a
    // second pass over the rows finds the start.
    const bool one_pass = num_rows <= (int)blockDim.x;
    unsigned long long total = 0, my_n = 0, my_start = 0;
    if (one_pass) {
        my_n = (int)threadIdx.x < num_rows ? ring_stages(context_lens[threadIdx.x]) : 0;
        my_start = ring_block_scan(my_n, warp_sums, total);
    } else {
        for (int base = 0; base < num_rows; base += blockDim.x) {
            const int r = base + threadIdx.x;
            unsigned long long sum;
            ring_block_scan(r < num_rows ? ring_stages(context_lens[r]) : 0, warp_sums, sum);
            total += sum;
        }
    }
    const unsigned long long grid = gridDim.x;
    const unsigned long long chunk = max((unsigned long long)max(min_chunk, 1), (total + grid - 1) / grid);
    const unsigned long long g0 = blockIdx.x * chunk;
    if (g0 >= total) {  // block-uniform: nothing left for this block
        if (threadIdx.x == 0) ws_own[blockIdx.x] = make_int4(-1, 0, 0, 0);
        return;
    }
    const unsigned long long g1 = min(total, g0 + chunk);
    // The row holding stage g0 (a row without keys holds none) and where its stages start.
    if (one_pass) {
        if (my_n > 0 && my_start <= g0 && g0 < my_start + my_n) {
            s_first_row = threadIdx.x;
            s_first_start = my_start;
        }
    } else {
        unsigned long long carry = 0;
        for (int base = 0; base < num_rows && carry <= g0; base += blockDim.x) {  // carry is block-uniform
            const int r = base + threadIdx.x;
            const unsigned long long n = r < num_rows ? ring_stages(context_lens[r]) : 0;
            unsigned long long sum;
            const unsigned long long start = carry + ring_block_scan(n, warp_sums, sum);
            if (n > 0 && start <= g0 && g0 < start + n) {
                s_first_row = r;
                s_first_start = start;
            }
            carry += sum;
        }
    }
    const int pos_elems = kv_heads * RING_D;
    const uint32_t pos_bytes = (uint32_t)pos_elems * sizeof(T);
    const size_t stage_bytes = 2 * (size_t)RING_CP * pos_bytes;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        for (int i = 0; i < depth; ++i) {
            mbar_init(smem_addr(&full[i]), 1);
            mbar_init(smem_addr(&empty[i]), cwarps);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Producer and consumers walk the same rows: row r's stages [lo, hi) are the run's part of it,
    // and i counts the block's stages (ring slot i % depth, round i / depth).
    int r = s_first_row;
    unsigned long long row_start = s_first_start, g = g0;
    int i = 0;
    if (warp == cwarps) {  // the producer: one thread issues every copy of the block
        if (lane != 0) return;
        while (g < g1) {
            const int ctx = (int)context_lens[r];
            const unsigned long long n = ring_stages((uint32_t)ctx);
            if (g >= row_start + n) {  // past this row (or a row without keys)
                row_start += n;
                ++r;
                continue;
            }
            const int lo = (int)(g - row_start), hi = (int)(min(g1, row_start + n) - row_start);
            const uint32_t *table = block_tables + (size_t)r * max_blocks;
            for (int j = lo; j < hi; ++j, ++i) {
                const int s = i % depth, round = i / depth;
                // Stage s is free once every consumer warp released its previous round.
                if (round > 0) mbar_wait(smem_addr(&empty[s]), (round - 1) & 1);
                // With ROPE the newest position comes from registers: the cache holds ctx - 1.
                const int p = j * RING_CP, cnt = min(RING_CP, ctx - (ROPE ? 1 : 0) - p);
                // RING_CP divides block_size and stages start on a multiple of it: one page.
                const size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
                const uint32_t bar = smem_addr(&full[s]);
                mbar_arrive_expect_tx(bar, 2 * cnt * pos_bytes);
                unsigned char *st = ring_smem + (size_t)s * stage_bytes;
                if (!ROPE || cnt > 0) {  // a last stage of only the newest position arrives empty
                    bulk_copy_g2s(smem_addr(st), kc + slot * pos_elems, cnt * pos_bytes, bar);
                    bulk_copy_g2s(smem_addr(st + RING_CP * pos_bytes), vc + slot * pos_elems, cnt * pos_bytes, bar);
                }
            }
            g = row_start + hi;
        }
        return;
    }
    // Consumers. A half-warp past the last head (odd head counts) runs along without writing:
    // its lanes take part in the warp's shuffles.
    const int head = 2 * warp + (lane >> 4), l16 = lane & 15;
    const bool valid = head < num_heads;
    const int kvh = (valid ? head : 0) / (num_heads / kv_heads);
    const int off = kvh * RING_D + 8 * l16;
    // The next row's query, loaded while this row's stages stream: its two dependent loads
    // (cu_q, then q) would otherwise stall the consumers at every row boundary of the run.
    // With ROPE, q's elements come unrotated out of qkv, with the row's cos / sin (rotated at use:
    // the rotation's shuffle would wait on the loads).
    const size_t qkv_width = (size_t)(num_heads + 2 * kv_heads) * RING_D;
    const int rope_i = (8 * l16) & (RING_D / 2 - 1);
    auto load_q = [&](int row) {
        if (ROPE)
            return valid ? ldg16(rope.qkv + (size_t)cu_q[row] * qkv_width + (size_t)head * RING_D + 8 * l16) : make_uint4(0, 0, 0, 0);
        return valid ? ldg16(q + ((size_t)cu_q[row] * num_heads + head) * RING_D + 8 * l16) : make_uint4(0, 0, 0, 0);
    };
    auto load_cs = [&](int row, uint4 &c, uint4 &sn) {
        const size_t t = cu_q[row];
        c = ldg16(rope.cos_t + t * (RING_D / 2) + rope_i);
        sn = ldg16(rope.sin_t + t * (RING_D / 2) + rope_i);
    };
    int next_row = -1;
    uint4 next_q = make_uint4(0, 0, 0, 0), next_c = next_q, next_s = next_q;
    int4 own = make_int4(-1, 0, 0, 0);
    while (g < g1) {
        const int ctx = (int)context_lens[r];
        const unsigned long long n = ring_stages((uint32_t)ctx);
        if (g >= row_start + n) {
            row_start += n;
            ++r;
            continue;
        }
        const int lo = (int)(g - row_start), hi = (int)(min(g1, row_start + n) - row_start);
        const int token = (int)cu_q[r];
        float qv[8], acc[8];
        uint4 qx = r == next_row ? next_q : load_q(r), qc = next_c, qs = next_s;
        if (ROPE) {
            if (r != next_row) load_cs(r, qc, qs);
            qx = rope_vec<T>(qx, shfl_xor4(qx, 8), qc, qs, l16 < 8);
        }
        Cvt<T>::to_float(qx, qv);
#pragma unroll
        for (int e = 0; e < 8; ++e) qv[e] *= scale_log2;
        if (row_start + n < g1 && r + 1 < num_rows) {  // the run goes on past this row
            next_row = r + 1;
            next_q = load_q(next_row);
            if (ROPE) load_cs(next_row, next_c, next_s);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
        float m = -INFINITY, l = 0.f;
        for (int j = lo; j < hi; ++j, ++i) {
            const int s = i % depth;
            // Every consumer warp takes every stage in order, so it waits on a stage's round only
            // after releasing the round before: parity waits cannot alias.
            mbar_wait(smem_addr(&full[s]), (i / depth) & 1);
            const T *ks = reinterpret_cast<const T *>(ring_smem + (size_t)s * stage_bytes);
            const int cnt = min(RING_CP, ctx - (ROPE ? 1 : 0) - j * RING_CP);
            if (cnt == RING_CP)  // warp-uniform
                ring_stage<T, true>(ks, pos_elems, off, cnt, qv, m, l, acc, smem_addr(&empty[s]), lane);
            else
                ring_stage<T, false>(ks, pos_elems, off, cnt, qv, m, l, acc, smem_addr(&empty[s]), lane);
        }
        if (ROPE && hi == (int)n) {  // the row's newest key and value, from qkv
            const T *row_qkv = rope.qkv + (size_t)token * qkv_width;
            const uint4 kx = ldg16(row_qkv + (size_t)(num_heads + kvh) * RING_D + 8 * l16);
            const uint4 vx = ldg16(row_qkv + (size_t)(num_heads + kv_heads + kvh) * RING_D + 8 * l16);
            const uint4 kr = rope_vec<T>(kx, shfl_xor4(kx, 8), qc, qs, l16 < 8);
            const float d = ring_score<T>(qv, kr);
            float vf[8];
            Cvt<T>::to_float(vx, vf);
            const float mx = fmaxf(m, d);
            if (mx != -INFINITY) {
                const float alpha = exp2f(m - mx), pr = exp2f(d - mx);
                m = mx;
                l = l * alpha + pr;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[e] = fmaf(pr, vf[e], acc[e] * alpha);
            }
            // For later steps: one head of each group writes its kv head.
            const long long slot = rope.slots[token];
            if (valid && head % (num_heads / kv_heads) == 0 && slot < rope.num_slots) {
                *reinterpret_cast<uint4 *>(rope.k_cache + slot * pos_elems + kvh * RING_D + 8 * l16) = kr;
                *reinterpret_cast<uint4 *>(rope.v_cache + slot * pos_elems + kvh * RING_D + 8 * l16) = vx;
            }
        }
        const int last_block = (int)((row_start + n - 1) / chunk);
        if (lo == 0 && last_block != (int)blockIdx.x)  // split here: this block holds its first stage
            own = make_int4(r, (int)blockIdx.x + r, last_block - (int)blockIdx.x + 1, 0);
        if (valid) {
            if (lo == 0 && last_block == (int)blockIdx.x) {  // the whole row: the output itself
                const float inv = l > 0.f ? 1.f / l : 0.f;
                __align__(16) T o[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) o[e] = Cvt<T>::from_float(acc[e] * inv);
                *reinterpret_cast<uint4 *>(out + ((size_t)token * num_heads + head) * RING_D + 8 * l16) =
                    *reinterpret_cast<const uint4 *>(o);
            } else {
                const size_t sh = ((size_t)blockIdx.x + r) * num_heads + head;
                if (l > 0.f) {  // the combine reads no acc of an empty partial
                    float4 *a = reinterpret_cast<float4 *>(ws_acc + sh * RING_D + 8 * l16);
                    a[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
                    a[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
                }
                if (l16 == 0) {
                    ws_ml[sh * 2] = m;
                    ws_ml[sh * 2 + 1] = l;
                }
            }
        }
        g = row_start + hi;
    }
    if (threadIdx.x == 0) ws_own[blockIdx.x] = own;  // consumer warp 0 walked every row of the run
#endif
}

// merge_partials for one head of RING_D elements, a warp (four elements a lane): the first
// RING_MERGE_BATCH partials' loads are issued together, so the usual count waits on L2 once rather
// than twice a partial; sums run in slot order as in merge_partials. Partial s of head h is slot
// first + s of `ws_acc` [slot, heads, D] and `ws_ml` [slot, heads, 2]; a partial without keys
// wrote no acc, and what its slot holds is dropped with it.
#define RING_MERGE_BATCH 8
template <typename T>
__device__ __forceinline__ void ring_merge_head(T *__restrict__ o, const float *__restrict__ ws_acc,
                                                const float *__restrict__ ws_ml, int first, int count, int h,
                                                int num_heads, int lane) {
    const auto slot = [&](int s) { return (size_t)(first + s) * num_heads + h; };
    float2 ml[RING_MERGE_BATCH];
    float4 a[RING_MERGE_BATCH];
#pragma unroll
    for (int b = 0; b < RING_MERGE_BATCH; ++b) {
        const bool ok = b < count;
        ml[b] = ok ? *reinterpret_cast<const float2 *>(ws_ml + slot(b) * 2) : make_float2(-INFINITY, 0.f);
        a[b] = ok ? *reinterpret_cast<const float4 *>(ws_acc + slot(b) * RING_D + 4 * lane) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float M = -INFINITY;
#pragma unroll
    for (int b = 0; b < RING_MERGE_BATCH; ++b) M = fmaxf(M, ml[b].x);
    for (int s = RING_MERGE_BATCH; s < count; ++s) M = fmaxf(M, ws_ml[slot(s) * 2]);
    float L = 0.f, A[4] = {0.f, 0.f, 0.f, 0.f};
    const auto add = [&](float2 p, float4 v) {
        if (p.y > 0.f) {
            const float f = exp2f(p.x - M);
            L += p.y * f;
            A[0] += v.x * f;
            A[1] += v.y * f;
            A[2] += v.z * f;
            A[3] += v.w * f;
        }
    };
    if (M != -INFINITY) {
#pragma unroll
        for (int b = 0; b < RING_MERGE_BATCH; ++b) add(ml[b], a[b]);
        for (int s = RING_MERGE_BATCH; s < count; ++s) {
            const float2 p = *reinterpret_cast<const float2 *>(ws_ml + slot(s) * 2);
            if (p.y > 0.f) add(p, *reinterpret_cast<const float4 *>(ws_acc + slot(s) * RING_D + 4 * lane));
        }
    }
    __align__(8) T out4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) out4[e] = Cvt<T>::from_float(L > 0.f ? A[e] / L : 0.f);
    *reinterpret_cast<uint2 *>(o + 4 * lane) = *reinterpret_cast<const uint2 *>(out4);
}

// Grid: the ring kernel's; a warp a head at a time. Block b merges the row the ring's block b
// split (ws_own[b]) — one wave, and only as many merges as rows were cut — and writes zeros for
// the rows without keys among b, b + grid, ... (the ring skips them); rows one block walked whole
// the ring wrote itself.
template <typename T>
__device__ __forceinline__ void ring_combine_impl(T *__restrict__ out, const float *__restrict__ ws_acc,
                                                  const float *__restrict__ ws_ml, const int4 *__restrict__ ws_own,
                                                  const uint32_t *__restrict__ context_lens,
                                                  const uint32_t *__restrict__ cu_q, int num_rows, int num_heads) {
    const int4 own = ws_own[blockIdx.x];
    for (int r = blockIdx.x; r < num_rows; r += gridDim.x) {
        if (context_lens[r] != 0) continue;
        T *o = out + (size_t)cu_q[r] * num_heads * RING_D;
        for (int e = threadIdx.x; e < num_heads * RING_D; e += blockDim.x) o[e] = Cvt<T>::from_float(0.f);
    }
    if (own.x < 0) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    T *o = out + (size_t)cu_q[own.x] * num_heads * RING_D;
    for (int h = warp; h < num_heads; h += blockDim.x >> 5)
        ring_merge_head<T>(o + (size_t)h * RING_D, ws_acc, ws_ml, own.y, own.z, h, num_heads, lane);
}

}  // namespace

#define PA_RING_KERNEL(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(288) paged_decode_ring_##NAME##_d128(           \
        T *out, float *ws_acc, float *ws_ml, int4 *ws_own, const T *q, const T *kc, const T *vc,  \
        const uint32_t *block_tables, const uint32_t *context_lens, const uint32_t *cu_q,        \
        int num_rows, int max_blocks, int num_heads, int kv_heads, int block_size,               \
        float scale_log2, int depth, int min_chunk) {                                            \
        paged_decode_ring_impl<T>(out, ws_acc, ws_ml, ws_own, q, kc, vc, block_tables,           \
                                  context_lens, cu_q, num_rows, max_blocks, num_heads, kv_heads, \
                                  block_size, scale_log2, depth, min_chunk);                     \
    }                                                                                            \
    extern "C" __global__ void paged_decode_ring_combine_##NAME##_d128(                          \
        T *out, const float *ws_acc, const float *ws_ml, const int4 *ws_own,                     \
        const uint32_t *context_lens, const uint32_t *cu_q, int num_rows, int num_heads) {       \
        ring_combine_impl<T>(out, ws_acc, ws_ml, ws_own, context_lens, cu_q, num_rows,           \
                             num_heads);                                                         \
    }

// The ring with qkv_rope_write folded in: the ring kernel's arguments (q unused), then the fused
// QKV output, cos / sin [T, D/2], the slot each token's K / V is written to, and the caches' slot
// count. kc / vc are written (each row's newest key and value).
#define PA_RING_ROPE_KERNEL(NAME, T)                                                             \
    extern "C" __global__ void __launch_bounds__(288) paged_decode_ring_rope_##NAME##_d128(      \
        T *out, float *ws_acc, float *ws_ml, int4 *ws_own, const T *q, T *kc, T *vc,             \
        const uint32_t *block_tables, const uint32_t *context_lens, const uint32_t *cu_q,        \
        int num_rows, int max_blocks, int num_heads, int kv_heads, int block_size,               \
        float scale_log2, int depth, int min_chunk, const T *qkv, const T *cos_t,                \
        const T *sin_t, const uint32_t *slots, long long num_slots) {                            \
        RingRope<T> rope;                                                                        \
        rope.qkv = qkv;                                                                          \
        rope.cos_t = cos_t;                                                                      \
        rope.sin_t = sin_t;                                                                      \
        rope.slots = slots;                                                                      \
        rope.k_cache = kc;                                                                       \
        rope.v_cache = vc;                                                                       \
        rope.num_slots = num_slots;                                                              \
        paged_decode_ring_impl<T, true>(out, ws_acc, ws_ml, ws_own, q, kc, vc, block_tables,     \
                                        context_lens, cu_q, num_rows, max_blocks, num_heads,     \
                                        kv_heads, block_size, scale_log2, depth, min_chunk,      \
                                        rope);                                                   \
    }

PA_RING_KERNEL(bf16, __nv_bfloat16)
PA_RING_KERNEL(f16, __half)
PA_RING_ROPE_KERNEL(bf16, __nv_bfloat16)
PA_RING_ROPE_KERNEL(f16, __half)
