// Fused per-layer ops of the looped decoders (ponder). Each replaces a chain of small candle ops
// whose cost at decode widths is the launches, not the work. Math in f32; every value the
// reference composition rounds to the storage dtype is rounded here at the same place.
//
// qkv_rope_write_*: split the fused QKV projection [T, (H + 2*KVH) * D], rotate q and k
//   (split-half / rotate_half RoPE, cos/sin [T, D/2]), write rotated k and v into the paged
//   caches at slot_mapping[t] (flat row block*block_size+offset of [NB*BS, KVH*D]), return q.
// add_rms_norm_*: h2 = residual + T(rms_norm(x, w_x)); out = T(rms_norm(h2, w_next)). One block
//   per row, f32 sums (candle's rmsnorm: scale = rsqrt(mean(x^2) + eps), y = T(scale * x * w));
//   16-byte vectors kept in registers when the width and the pointers allow.
// post_norm_*: h2 = T(rms_norm(T(res + x), w)); out = T(rms_norm(h2, w_next)) — a residual
//   stream normalised after each add (Huginn's sandwich blocks) and the norm that reads it next,
//   rounded as the two norms launched apart. One block per row, as above.
// rms_norm_*, add_rms_norm_pre_*: n = T(rsqrt(mean(h^2) + eps) * h * w) per row, h = x, or for
//   the pre-norm residual stream h = T(res + x) (also written out). One block per row, as above.
// add_rms_norm_parts_*, post_norm_parts_*, add_rms_norm_pre_parts_*: the same with x = T(sum of
//   f32 partial products [nparts, rows, ncols]) of a projection split over k (`Parts` below).
// residual_add_*: out = T(a + b), element-wise over tensors of one shape.
// silu_mul_*: out = T(T(silu(gate)) * up) over [T, 2I] -> [T, I].
// rope_angles_*: cos / sin [T, D/2] of float(pos[t]) * inv_freq[j], rounded to T (the per-launch
//   RoPE angles in one launch instead of candle's cast, mul, cos, sin and two casts).
// greedy_flagged_*: the greedy id of each row and the same id flagged (+ vocab) where the row's
//   sum is not finite, in one pass (the looped decode's greedy readout).
// row_dot_f32_*: an exit gate's logit per row (f32 weight and bias over a row of the state).
// latent_change_*: a core step's relative latent change per row, ||new - old|| / ||new|| in f32
//   over the first `cols` columns (the s half of a looped state), one block per row.
// scatter_rows_*, gather_rows_*, copy_rows_in_place_*, compact_rows_*: row copies (paged K/V
//   writes, loop-state bank writes and reads, K/V slot copies across every layer in one launch;
//   FOCUS compaction); gather_rows_scaled_*: a gather times a scale, rounded as candle's affine.
// qkv_bias_rope_i_write_*: qkv_rope_write for interleaved RoPE (pairs 2i, 2i + 1; Huginn), with
//   an optional learned bias on q and k added before it ([H, D] and [KVH, D]). Rounded as the
//   CPU composition it replaces rounds (candle's broadcast add, then rope_i in T's own
//   arithmetic): T(x + b), then T(T(x1 c) - T(x2 s)) and T(T(x1 s) + T(x2 c)); candle's CUDA
//   rope_i differs from that by a last bit in some values.
// qkv_norm_rope_write_*: qkv_rope_write with an optional per-head RMSNorm of q and k (weights
//   [D], candle's rmsnorm rounding) before RoPE (Qwen3 / SDAR), one warp per (token, head) over
//   the q, k and v heads, each lane D / 32 consecutive elements as one vector; also returns
//   rotated k and v [T, KVH, D] (FOCUS scores them).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

// The row norms' largest block (row_norm_config in src/ops/cuda/fused.rs caps its threads here):
// their loads are held in registers to be issued together, which a 1024-thread block cannot
// give them (64 registers a thread).
#define ROW_NORM_MAX_THREADS 512
#define ROW_NORM_BOUNDS __launch_bounds__(ROW_NORM_MAX_THREADS)

#include "floats.cuh"

namespace {

// Sum over the block (blockDim.x a multiple of 32, at most 1024). Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float *smem) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nwarps = blockDim.x >> 5;
    __syncthreads(); // smem may still be read from a previous call
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = lane < nwarps ? smem[lane] : 0.f;
    return warp_sum(v);
}

// grid (T, ceil(pairs / blockDim)); pairs = (H + KVH) * D/2 rotated pairs + KVH * D/2 v pairs.
template <typename T>
__device__ void qkv_rope_write(T *__restrict__ q_out, T *__restrict__ k_cache, T *__restrict__ v_cache,
                               const T *__restrict__ qkv, const T *__restrict__ cos_t,
                               const T *__restrict__ sin_t, const uint32_t *__restrict__ slots,
                               int heads, int kv_heads, int head_dim, long long num_slots) {
    const int t = blockIdx.x;
    const int half = head_dim >> 1;
    const int rot_pairs = (heads + kv_heads) * half;
    const int total = rot_pairs + kv_heads * half;
    const int p = blockIdx.y * blockDim.x + threadIdx.x;
    if (p >= total) return;
    const long long width = (long long)(heads + 2 * kv_heads) * head_dim;
    const T *row = qkv + (long long)t * width;
    const long long kv_width = (long long)kv_heads * head_dim;
    const long long slot = (long long)slots[t];
    const bool slot_ok = slot < num_slots;
    if (p < rot_pairs) {
        const int head = p / half;
        const int i = p - head * half;
        const float x1 = to_f(row[head * head_dim + i]);
        const float x2 = to_f(row[head * head_dim + i + half]);
        const float c = to_f(cos_t[(long long)t * half + i]);
        const float s = to_f(sin_t[(long long)t * half + i]);
        const T o1 = from_f<T>(x1 * c - x2 * s);
        const T o2 = from_f<T>(x1 * s + x2 * c);
        T *dst;
        if (head < heads) {
            dst = q_out + ((long long)t * heads + head) * head_dim;
        } else {
            if (!slot_ok) return;
            dst = k_cache + slot * kv_width + (long long)(head - heads) * head_dim;
        }
        dst[i] = o1;
        dst[i + half] = o2;
    } else {
        if (!slot_ok) return;
        const int j = p - rot_pairs; // v elements j and j + KVH*D/2
        const T *v = row + (long long)(heads + kv_heads) * head_dim;
        T *dst = v_cache + slot * kv_width;
        const int hw = kv_heads * half;
        dst[j] = v[j];
        dst[j + hw] = v[j + hw];
    }
}

// grid (T, ceil(pairs / blockDim)), pairs as qkv_rope_write's. bias_q / bias_k null: no bias.
template <typename T>
__device__ void qkv_bias_rope_i_write(T *__restrict__ q_out, T *__restrict__ k_cache, T *__restrict__ v_cache,
                                      const T *__restrict__ qkv, const T *__restrict__ bias_q,
                                      const T *__restrict__ bias_k, const T *__restrict__ cos_t,
                                      const T *__restrict__ sin_t, const uint32_t *__restrict__ slots, int heads,
                                      int kv_heads, int head_dim, long long num_slots) {
    const int t = blockIdx.x;
    const int half = head_dim >> 1;
    const int rot_pairs = (heads + kv_heads) * half;
    const int total = rot_pairs + kv_heads * half;
    const int p = blockIdx.y * blockDim.x + threadIdx.x;
    if (p >= total) return;
    const long long width = (long long)(heads + 2 * kv_heads) * head_dim;
    const T *row = qkv + (long long)t * width;
    const long long kv_width = (long long)kv_heads * head_dim;
    const long long slot = (long long)slots[t];
    const bool slot_ok = slot < num_slots;
    if (p < rot_pairs) {
        const int head = p / half;
        const int i = p - head * half;
        const bool is_q = head < heads;
        const long long e = (long long)head * head_dim + 2 * i; // the pair's first element in the row
        float x1 = to_f(row[e]), x2 = to_f(row[e + 1]);
        const T *bias = is_q ? bias_q : bias_k;
        if (bias != nullptr) {
            const long long b = (long long)(is_q ? head : head - heads) * head_dim + 2 * i;
            x1 = round_t<T>(x1 + to_f(bias[b]));
            x2 = round_t<T>(x2 + to_f(bias[b + 1]));
        }
        const float c = to_f(cos_t[(long long)t * half + i]);
        const float s = to_f(sin_t[(long long)t * half + i]);
        const T o1 = from_f<T>(round_t<T>(x1 * c) - round_t<T>(x2 * s));
        const T o2 = from_f<T>(round_t<T>(x1 * s) + round_t<T>(x2 * c));
        T *dst;
        if (is_q) {
            dst = q_out + ((long long)t * heads + head) * head_dim;
        } else {
            if (!slot_ok) return;
            dst = k_cache + slot * kv_width + (long long)(head - heads) * head_dim;
        }
        dst[2 * i] = o1;
        dst[2 * i + 1] = o2;
    } else {
        if (!slot_ok) return;
        const int j = p - rot_pairs; // v elements j and j + KVH*D/2
        const T *v = row + (long long)(heads + kv_heads) * head_dim;
        T *dst = v_cache + slot * kv_width;
        const int hw = kv_heads * half;
        dst[j] = v[j];
        dst[j + hw] = v[j + hw];
    }
}

// The largest power of two dividing `bytes`, at most 16: the widest vector access of a pack.
constexpr unsigned pack_align(unsigned bytes) { return (bytes & (0u - bytes)) < 16u ? (bytes & (0u - bytes)) : 16u; }

// PER consecutive elements of T, loaded and stored as one vector (or a few 16-byte ones).
template <typename T, int PER> struct alignas(pack_align(PER * sizeof(T))) Pack {
    T v[PER];
};
static_assert(pack_align(12) == 4 && sizeof(Pack<__nv_bfloat16, 2>) == 4 && alignof(Pack<__nv_bfloat16, 6>) == 4, "packs are unpadded");
static_assert(sizeof(Pack<float, 8>) == 32 && alignof(Pack<float, 8>) == 16, "packs are unpadded");

// One warp per (token, head), lane l holding elements PER l .. PER l + PER - 1 of the head
// (PER = D / 32): its split-half RoPE partner, D / 2 = 16 PER elements away, is lane l ^ 16.
template <typename T, int PER>
__device__ void qkv_norm_rope_head(T *__restrict__ q_out, T *__restrict__ k_out, T *__restrict__ v_out,
                                   T *__restrict__ k_cache, T *__restrict__ v_cache, const T *__restrict__ qkv,
                                   const T *__restrict__ q_w, const T *__restrict__ k_w, int has_norm,
                                   const T *__restrict__ cos_t, const T *__restrict__ sin_t, const uint32_t *__restrict__ slots,
                                   int heads, int kv_heads, float eps, long long num_slots, int unit) {
    using P = Pack<T, PER>;
    constexpr int D = 32 * PER, HALF = D / 2;
    const int t = blockIdx.x, lane = threadIdx.x & 31;
    const int units = heads + 2 * kv_heads;
    const P in = *reinterpret_cast<const P *>(qkv + ((long long)t * units + unit) * D + PER * lane);
    const long long slot = (long long)slots[t];
    const bool slot_ok = slot < num_slots;
    const long long kv_width = (long long)kv_heads * D;
    if (unit >= heads + kv_heads) {
        const int vh = unit - heads - kv_heads;
        *reinterpret_cast<P *>(v_out + ((long long)t * kv_heads + vh) * D + PER * lane) = in;
        if (slot_ok) *reinterpret_cast<P *>(v_cache + slot * kv_width + (long long)vh * D + PER * lane) = in;
        return;
    }
    float x[PER];
#pragma unroll
    for (int j = 0; j < PER; ++j) x[j] = to_f(in.v[j]);
    const bool is_q = unit < heads;
    if (has_norm) {
        const P w = *reinterpret_cast<const P *>((is_q ? q_w : k_w) + PER * lane);
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < PER; ++j) ss += x[j] * x[j];
        const float scale = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
        for (int j = 0; j < PER; ++j) x[j] = round_t<T>(x[j] * scale * to_f(w.v[j]));
    }
    const long long angle = (long long)t * HALF + PER * (lane & 15);
    const P c = *reinterpret_cast<const P *>(cos_t + angle), sn = *reinterpret_cast<const P *>(sin_t + angle);
    P o;
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const float other = __shfl_xor_sync(0xffffffffu, x[j], 16);
        const float cj = to_f(c.v[j]), sj = to_f(sn.v[j]);
        // Lanes 0-15 hold x1 (first half), lanes 16-31 x2: o1 = x1 c - x2 s, o2 = x1 s + x2 c.
        o.v[j] = lane < 16 ? from_f<T>(x[j] * cj - other * sj) : from_f<T>(other * sj + x[j] * cj);
    }
    if (is_q) {
        *reinterpret_cast<P *>(q_out + ((long long)t * heads + unit) * D + PER * lane) = o;
    } else {
        const int kh = unit - heads;
        *reinterpret_cast<P *>(k_out + ((long long)t * kv_heads + kh) * D + PER * lane) = o;
        if (slot_ok) *reinterpret_cast<P *>(k_cache + slot * kv_width + (long long)kh * D + PER * lane) = o;
    }
}

// grid (T, ceil((H + 2*KVH) / warps per block)); D a multiple of 64, at most 256; every pointer
// 16-byte aligned.
template <typename T>
__device__ void qkv_norm_rope_write(T *__restrict__ q_out, T *__restrict__ k_out, T *__restrict__ v_out,
                                    T *__restrict__ k_cache, T *__restrict__ v_cache,
                                    const T *__restrict__ qkv, const T *__restrict__ q_w,
                                    const T *__restrict__ k_w, int has_norm, const T *__restrict__ cos_t,
                                    const T *__restrict__ sin_t, const uint32_t *__restrict__ slots,
                                    int heads, int kv_heads, int head_dim, float eps, long long num_slots) {
    const int unit = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (unit >= heads + 2 * kv_heads) return;
#define QKV_HEAD(PER)                                                                                          \
    qkv_norm_rope_head<T, PER>(q_out, k_out, v_out, k_cache, v_cache, qkv, q_w, k_w, has_norm, cos_t, sin_t, slots, \
                               heads, kv_heads, eps, num_slots, unit)
    switch (head_dim) {
    case 64: QKV_HEAD(2); break;
    case 128: QKV_HEAD(4); break;
    case 192: QKV_HEAD(6); break;
    case 256: QKV_HEAD(8); break;
    default: break; // the host checks head_dim
    }
#undef QKV_HEAD
}

// The end every row norm here shares: with `acc` this thread's part of sum(h^2) over the row,
// n = T(rsqrt(mean(h^2) + eps) * h * w) — from h held in registers (`hf`, the thread's vectors
// i = threadIdx.x + j * blockDim.x of the row, with w's vectors already loaded: `load_vecs`), or
// read back from `h` (each thread only the elements it wrote itself, or the input).
template <typename T, int V, int MAXV>
__device__ __forceinline__ void store_norm_vec(const float (&hf)[MAXV][V], float acc, const uint4 (&wraw)[MAXV],
                                               T *__restrict__ n_row, int ncols, float eps, float *smem) {
    const float s = rsqrtf(block_sum(acc, smem) / ncols + eps);
    uint4 *nv = reinterpret_cast<uint4 *>(n_row);
    const int nvec = ncols / V;
#pragma unroll
    for (int j = 0; j < MAXV; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < nvec) {
            const T *wk = reinterpret_cast<const T *>(&wraw[j]);
            uint4 out;
            T *o = reinterpret_cast<T *>(&out);
#pragma unroll
            for (int k = 0; k < V; ++k) o[k] = from_f<T>(s * hf[j][k] * to_f(wk[k]));
            nv[i] = out;
        }
    }
}

// This thread's vectors i = threadIdx.x + j * blockDim.x (< nvec) of a row of T (weights, the
// residual), loaded before the row's first reduction so that every load of a norm is one round
// trip: a block per row at decode widths is latency-bound, and each load issued after a
// __syncthreads costs a trip of its own.
template <int MAXV>
__device__ __forceinline__ void load_vecs(const void *__restrict__ row, int nvec, uint4 (&raw)[MAXV]) {
    const uint4 *v = reinterpret_cast<const uint4 *>(row);
#pragma unroll
    for (int j = 0; j < MAXV; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        raw[j] = i < nvec ? v[i] : make_uint4(0, 0, 0, 0);
    }
}

template <typename T>
__device__ __forceinline__ void store_norm_scalar(const T *h_row, float acc, const T *__restrict__ w,
                                                  T *n_row, int ncols, float eps, float *smem) {
    const float s = rsqrtf(block_sum(acc, smem) / ncols + eps);
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) n_row[c] = from_f<T>(s * to_f(h_row[c]) * to_f(w[c]));
}

// Where a row norm's input x comes from. `Plain`: a tensor of T. `Parts`: the f32 partial
// products of a projection split over k (`n` slices `stride` floats apart), summed in slice order
// and rounded to T — the value the unsplit projection would have stored. Element `e` is an index
// into x's rows; `vec` loads the V elements from `e` (e a multiple of V; `aligned` holds).
template <typename T> struct Plain {
    const T *x;
    __device__ __forceinline__ float at(long long e) const { return to_f(x[e]); }
    template <int V> __device__ __forceinline__ void vec(long long e, float (&f)[V]) const {
        const uint4 raw = *reinterpret_cast<const uint4 *>(x + e);
        const T *t = reinterpret_cast<const T *>(&raw);
#pragma unroll
        for (int k = 0; k < V; ++k) f[k] = to_f(t[k]);
    }
    __device__ __forceinline__ bool aligned() const { return (uintptr_t)x % 16 == 0; }
};

template <typename T> struct Parts {
    const float *p;
    long long stride;
    int n;
    __device__ __forceinline__ float at(long long e) const {
        float s = 0.f;
        for (int i = 0; i < n; ++i) s += p[i * stride + e];
        return round_t<T>(s);
    }
    template <int V> __device__ __forceinline__ void vec(long long e, float (&f)[V]) const {
#pragma unroll
        for (int k = 0; k < V; ++k) f[k] = 0.f;
        for (int i = 0; i < n; ++i) {
            const float4 *v = reinterpret_cast<const float4 *>(p + i * stride + e);
#pragma unroll
            for (int q = 0; q < V / 4; ++q) {
                const float4 a = v[q];
                f[4 * q] += a.x;
                f[4 * q + 1] += a.y;
                f[4 * q + 2] += a.z;
                f[4 * q + 3] += a.w;
            }
        }
#pragma unroll
        for (int k = 0; k < V; ++k) f[k] = round_t<T>(f[k]);
    }
    __device__ __forceinline__ bool aligned() const { return ((uintptr_t)p | (uintptr_t)(stride * 4)) % 16 == 0; }
};

// This thread's vectors i = threadIdx.x + j * blockDim.x (< nvec) of row `base`, as floats into
// f[j]; returns the sum of their squares (element order).
template <typename T, int V, int MAXV, class X>
__device__ __forceinline__ float load_row_vec(const X &x, long long base, int nvec, float (&f)[MAXV][V]) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < MAXV; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < nvec) {
            x.template vec<V>(base + (long long)i * V, f[j]);
#pragma unroll
            for (int k = 0; k < V; ++k) acc += f[j][k] * f[j][k];
        }
    }
    return acc;
}

// grid (rows), block a multiple of 32.
// add_rms_norm in 16-byte vectors held in registers: each thread loads its (at most MAXV)
// vectors of x, the residual and both weights once, and writes h and the norm once — no read-back
// of h and no dependent scalar-load loops (the scalar version below was latency-bound: ~12 us a
// row batch on the H200 whatever the batch). The same arithmetic per element as the scalar path.
// POST (post_norm): the first norm reads the sum, h = T(rms_norm(T(res + x), w_x)), where the
// sandwich form adds the normalised branch to the residual, h = T(res + T(rms_norm(x, w_x))).
template <typename T, int V, int MAXV, bool POST, class X>
__device__ void add_rms_norm_vec(T *__restrict__ h_out, T *__restrict__ n_out, const T *__restrict__ res,
                                 const X &x, const T *__restrict__ w_x,
                                 const T *__restrict__ w_next, int ncols, float eps, float *smem) {
    const long long base = (long long)blockIdx.x * ncols;
    uint4 *hv = reinterpret_cast<uint4 *>(h_out + base);
    const int nvec = ncols / V;
    uint4 rraw[MAXV], wxraw[MAXV], wnraw[MAXV];
    load_vecs<MAXV>(res + base, nvec, rraw);
    load_vecs<MAXV>(w_x, nvec, wxraw);
    load_vecs<MAXV>(w_next, nvec, wnraw);
    float xf[MAXV][V];
    float acc = 0.f;
    if constexpr (POST) {
#pragma unroll
        for (int j = 0; j < MAXV; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < nvec) {
                x.template vec<V>(base + (long long)i * V, xf[j]);
                const T *r = reinterpret_cast<const T *>(&rraw[j]);
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    xf[j][k] = round_t<T>(to_f(r[k]) + xf[j][k]);  // the sum, as stored
                    acc += xf[j][k] * xf[j][k];
                }
            }
        }
    } else {
        acc = load_row_vec<T, V, MAXV>(x, base, nvec, xf);
    }
    const float s1 = rsqrtf(block_sum(acc, smem) / ncols + eps);
    acc = 0.f;
#pragma unroll
    for (int j = 0; j < MAXV; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < nvec) {
            const T *r = reinterpret_cast<const T *>(&rraw[j]);
            const T *w = reinterpret_cast<const T *>(&wxraw[j]);
            uint4 out;
            T *o = reinterpret_cast<T *>(&out);
#pragma unroll
            for (int k = 0; k < V; ++k) {
                if constexpr (POST) {
                    o[k] = from_f<T>(s1 * xf[j][k] * to_f(w[k]));
                } else {
                    const float n = round_t<T>(s1 * xf[j][k] * to_f(w[k]));
                    o[k] = from_f<T>(to_f(r[k]) + n);
                }
                xf[j][k] = to_f(o[k]);  // now h, as stored
                acc += xf[j][k] * xf[j][k];
            }
            hv[i] = out;
        }
    }
    store_norm_vec<T, V, MAXV>(xf, acc, wnraw, n_out + base, ncols, eps, smem);
}

template <typename T, bool POST, class X>
__device__ void add_rms_norm(T *__restrict__ h_out, T *__restrict__ n_out, const T *__restrict__ res,
                             const X &x, const T *__restrict__ w_x,
                             const T *__restrict__ w_next, int ncols, float eps) {
    __shared__ float smem[32];
    constexpr int V = 16 / sizeof(T);
    constexpr int MAXV = 4;
    const bool aligned = ((uintptr_t)h_out | (uintptr_t)n_out | (uintptr_t)res | (uintptr_t)w_x |
                          (uintptr_t)w_next) % 16 == 0 && x.aligned();
    if (aligned && ncols % V == 0 && ncols / V <= (int)blockDim.x * MAXV) {
        add_rms_norm_vec<T, V, MAXV, POST>(h_out, n_out, res, x, w_x, w_next, ncols, eps, smem);
        return;
    }
    const long long base = (long long)blockIdx.x * ncols;
    const T *rr = res + base;
    T *hr = h_out + base;
    T *nr = n_out + base;
    // The first norm's input: x, or the rounded sum (recomputed in the second pass rather than
    // stored: no output holds it).
    auto first = [&](int c) { return POST ? round_t<T>(to_f(rr[c]) + x.at(base + c)) : x.at(base + c); };
    float acc = 0.f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        const float v = first(c);
        acc += v * v;
    }
    const float s1 = rsqrtf(block_sum(acc, smem) / ncols + eps);
    acc = 0.f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        T h;
        if constexpr (POST) {
            h = from_f<T>(s1 * first(c) * to_f(w_x[c]));
        } else {
            const float n = round_t<T>(s1 * first(c) * to_f(w_x[c]));
            h = from_f<T>(to_f(rr[c]) + n);
        }
        hr[c] = h;
        const float hf = to_f(h);
        acc += hf * hf;
    }
    store_norm_scalar<T>(hr, acc, w_next, nr, ncols, eps, smem);
}

// grid (rows), block a multiple of 32. Pre-norm residual stream: h = T(res + x) (ADD; written
// to h_out) or h = x, then n = T(rsqrt(mean(h^2) + eps) * h * w). Vector path as in
// add_rms_norm_vec (candle's rmsnorm and its binary add with 2-byte scalar loads ran at about a
// quarter of the memory bandwidth on 8k-token diffusion launches).
template <typename T, int V, int MAXV, bool ADD, class X>
__device__ void rms_norm_vec(T *__restrict__ h_out, T *__restrict__ n_out, const T *__restrict__ res,
                             const X &x, const T *__restrict__ w, int ncols, float eps, float *smem) {
    const long long base = (long long)blockIdx.x * ncols;
    const uint4 *rv = reinterpret_cast<const uint4 *>(res + base);
    uint4 *hv = reinterpret_cast<uint4 *>(h_out + base);
    const int nvec = ncols / V;
    uint4 wraw[MAXV];
    load_vecs<MAXV>(w, nvec, wraw);
    float hf[MAXV][V];
    float acc = 0.f;
    if constexpr (!ADD) {
        acc = load_row_vec<T, V, MAXV>(x, base, nvec, hf);
    } else {
#pragma unroll
        for (int j = 0; j < MAXV; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < nvec) {
                float e[V];
                x.template vec<V>(base + (long long)i * V, e);
                const uint4 rraw = rv[i];
                const T *r = reinterpret_cast<const T *>(&rraw);
                uint4 out;
                T *o = reinterpret_cast<T *>(&out);
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    o[k] = from_f<T>(to_f(r[k]) + e[k]);
                    hf[j][k] = to_f(o[k]);
                }
                hv[i] = out;
#pragma unroll
                for (int k = 0; k < V; ++k) acc += hf[j][k] * hf[j][k];
            }
        }
    }
    store_norm_vec<T, V, MAXV>(hf, acc, wraw, n_out + base, ncols, eps, smem);
}

template <typename T, bool ADD, class X>
__device__ void rms_norm_rows(T *__restrict__ h_out, T *__restrict__ n_out, const T *__restrict__ res,
                              const X &x, const T *__restrict__ w, int ncols, float eps) {
    __shared__ float smem[32];
    constexpr int V = 16 / sizeof(T);
    constexpr int MAXV = 4;
    const uintptr_t ptrs = (uintptr_t)n_out | (uintptr_t)w | (ADD ? ((uintptr_t)h_out | (uintptr_t)res) : 0);
    if (ptrs % 16 == 0 && x.aligned() && ncols % V == 0 && ncols / V <= (int)blockDim.x * MAXV) {
        rms_norm_vec<T, V, MAXV, ADD>(h_out, n_out, res, x, w, ncols, eps, smem);
        return;
    }
    const long long base = (long long)blockIdx.x * ncols;
    float acc = 0.f;
    for (int c = threadIdx.x; c < ncols; c += blockDim.x) {
        float h = x.at(base + c);
        if constexpr (ADD) {
            const T ht = from_f<T>(to_f(res[base + c]) + h);
            h_out[base + c] = ht;
            h = to_f(ht);
        }
        acc += h * h;
    }
    if constexpr (ADD) {
        store_norm_scalar<T>(h_out + base, acc, w, n_out + base, ncols, eps, smem);
    } else {
        store_norm_scalar<T>(x.x + base, acc, w, n_out + base, ncols, eps, smem);
    }
}

// out = T(a + b) over n elements, grid-stride; 16-byte vectors when n and the pointers allow
// (candle's binary add reads bf16 two bytes at a time: a quarter of the bandwidth on block-sized
// activations).
template <typename T>
__device__ void residual_add(T *__restrict__ out, const T *__restrict__ a, const T *__restrict__ b, long long n) {
    constexpr int V = 16 / sizeof(T);
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (((uintptr_t)out | (uintptr_t)a | (uintptr_t)b) % 16 == 0 && n % V == 0) {
        const uint4 *av = reinterpret_cast<const uint4 *>(a);
        const uint4 *bv = reinterpret_cast<const uint4 *>(b);
        uint4 *ov = reinterpret_cast<uint4 *>(out);
        for (long long i = start; i < n / V; i += stride) {
            const uint4 ar = av[i], br = bv[i];
            const T *ae = reinterpret_cast<const T *>(&ar);
            const T *be = reinterpret_cast<const T *>(&br);
            uint4 o;
            T *oe = reinterpret_cast<T *>(&o);
#pragma unroll
            for (int k = 0; k < V; ++k) oe[k] = from_f<T>(to_f(ae[k]) + to_f(be[k]));
            ov[i] = o;
        }
        return;
    }
    for (long long i = start; i < n; i += stride) out[i] = from_f<T>(to_f(a[i]) + to_f(b[i]));
}

// Grid-stride over rows * inter outputs: V outputs a thread step from two 16-byte loads when
// the width and pointers allow (2-byte loads and a 64-bit division per element made a 16-row
// launch latency-bound and a 256-row one ≈ 8× its bytes' time), else one output a step. The same
// arithmetic per element either way.
template <typename T>
__device__ __forceinline__ T silu_times(float g, float u) {
    return from_f<T>(round_t<T>(g / (1.f + expf(-g))) * u);
}

// The arithmetic of candle's op chain (u32 -> f32 cast, f32 mul, cosf / sinf, round to T), so
// the angles are the same bits as the composition's on the device.
template <typename T>
__device__ void rope_angles(T *__restrict__ cos_out, T *__restrict__ sin_out, const uint32_t *__restrict__ pos,
                            const float *__restrict__ inv_freq, long long tokens, int half) {
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = start; e < tokens * half; e += stride) {
        const long long t = e / half;
        const float f = (float)pos[t] * inv_freq[e - t * half];
        cos_out[e] = from_f<T>(cosf(f));
        sin_out[e] = from_f<T>(sinf(f));
    }
}

template <typename T>
__device__ void silu_mul(T *__restrict__ out, const T *__restrict__ gu, long long rows, int inter) {
    constexpr int V = 16 / sizeof(T);
    const long long start = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (inter % V == 0 && ((uintptr_t)out | (uintptr_t)gu) % 16 == 0) {
        const int per_row = inter / V;
        for (long long e = start; e < rows * per_row; e += stride) {
            const long long r = e / per_row;
            const int c = (int)(e - r * per_row) * V;
            const uint4 graw = *reinterpret_cast<const uint4 *>(gu + r * 2 * inter + c);
            const uint4 uraw = *reinterpret_cast<const uint4 *>(gu + r * 2 * inter + inter + c);
            const T *g = reinterpret_cast<const T *>(&graw);
            const T *u = reinterpret_cast<const T *>(&uraw);
            uint4 o;
            T *oe = reinterpret_cast<T *>(&o);
#pragma unroll
            for (int k = 0; k < V; ++k) oe[k] = silu_times<T>(to_f(g[k]), to_f(u[k]));
            *reinterpret_cast<uint4 *>(out + r * inter + c) = o;
        }
        return;
    }
    for (long long e = start; e < rows * inter; e += stride) {
        const long long r = e / inter;
        const int i = (int)(e - r * inter);
        const T *row = gu + r * 2 * inter;
        out[e] = silu_times<T>(to_f(row[i]), to_f(row[inter + i]));
    }
}

// One row of `width` elements copied by the block, in 16-byte vectors when width and both
// addresses allow.
template <typename T>
__device__ __forceinline__ void copy_row(T *__restrict__ d, const T *__restrict__ s, int width) {
    constexpr int VEC = 16 / sizeof(T);
    if (width % VEC == 0 && ((uintptr_t)s % 16 == 0) && ((uintptr_t)d % 16 == 0)) {
        const uint4 *sv = reinterpret_cast<const uint4 *>(s);
        uint4 *dv = reinterpret_cast<uint4 *>(d);
        for (int i = threadIdx.x; i < width / VEC; i += blockDim.x) dv[i] = sv[i];
    } else {
        for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
    }
}

// Copies rows of `src` [rows, width] into rows `index[r]` of `dst` [dst_rows, width]: one block
// per source row (candle's scatter runs one thread per column over every row in turn).
template <typename T>
__device__ void scatter_rows(T *__restrict__ dst, const T *__restrict__ src, const uint32_t *__restrict__ index,
                             int width, long long dst_rows) {
    const long long r = blockIdx.x;
    const long long to = index[r];
    if (to >= dst_rows) return;  // checked on the host; never write out of bounds
    copy_row(dst + to * width, src + r * width, width);
}

// out[r] = bias + sum_k float(h[r, k]) * w[k] (w, bias f32): an exit gate's logit per row, with
// the row's cast to f32 folded into the load. One block per row.
template <typename T>
__device__ void row_dot_f32(float *__restrict__ out, const T *__restrict__ h, const float *__restrict__ w,
                            const float *__restrict__ bias, int k) {
    __shared__ float smem[32];
    const T *x = h + (long long)blockIdx.x * k;
    float acc = 0.f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) acc += to_f(x[i]) * w[i];
    acc = block_sum(acc, smem);
    if (threadIdx.x == 0) out[blockIdx.x] = acc + bias[0];
}

// out[r] = sqrt(sum (f32(nw) - f32(od))^2) / sqrt(sum f32(nw)^2) over the first `cols` columns of
// row r of `old_s` and `new_s` (rows `stride` elements apart): the relative latent change a
// latent-difference exit reads. One block per row.
template <typename T>
__device__ void latent_change(float *__restrict__ out, const T *__restrict__ old_s, const T *__restrict__ new_s,
                              int cols, long long stride) {
    __shared__ float smem[32];
    const T *od = old_s + (long long)blockIdx.x * stride;
    const T *nw = new_s + (long long)blockIdx.x * stride;
    float diff = 0.f, norm = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float n = to_f(nw[i]);
        const float d = n - to_f(od[i]);
        diff += d * d;
        norm += n * n;
    }
    diff = block_sum(diff, smem);
    norm = block_sum(norm, smem);
    if (threadIdx.x == 0) out[blockIdx.x] = sqrtf(diff) / sqrtf(norm);
}

// Copies rows `index[r]` of `src` [src_rows, width] into rows r of `dst` [rows, width]: one block
// per destination row (index_select's gather into a given buffer). An index past `src` (never
// one the host gives) leaves zeros rather than reading out of bounds.
template <typename T>
__device__ void gather_rows(T *__restrict__ dst, const T *__restrict__ src, const uint32_t *__restrict__ index,
                            int width, long long src_rows) {
    const long long r = blockIdx.x;
    const long long from = index[r];
    T *d = dst + r * width;
    if (from >= src_rows) {
        for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = from_f<T>(0.f);
        return;
    }
    copy_row(d, src + from * width, width);
}

// gather_rows scaling every value: dst[r] = T(float(src[index[r]]) * scale + 0), the rounding of
// candle's affine (`x * mul + add` in T with mul = T(scale), add = 0) over the gathered rows: the
// product of two values of T is exact in f32, so one rounding either way, and adding +0 turns a
// -0 into +0 as there. Huginn's prelude (the embedding rows times sqrt(hidden)).
template <typename T>
__device__ void gather_rows_scaled(T *__restrict__ dst, const T *__restrict__ src, const uint32_t *__restrict__ index,
                                   int width, long long src_rows, float scale) {
    const long long r = blockIdx.x;
    const long long from = index[r];
    T *d = dst + r * width;
    if (from >= src_rows) {
        for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = from_f<T>(0.f);
        return;
    }
    const T *s = src + from * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) d[i] = from_f<T>(to_f(s[i]) * scale + 0.f);
}

// Row copies inside each of a set of same-shaped tensors (the last-exited K/V fill: every
// layer's K and V): in tensor blockIdx.y, row dst[p] = row src[p], one block per (pair, tensor).
// The host checks the indices, that no destination is also a source and none repeats, so the
// order of the blocks is free.
template <typename T>
__device__ void copy_rows_in_place(const unsigned long long *__restrict__ bases, const uint32_t *__restrict__ src,
                                   const uint32_t *__restrict__ dst, int width, long long rows) {
    T *base = reinterpret_cast<T *>(bases[blockIdx.y]);
    const long long from = src[blockIdx.x], to = dst[blockIdx.x];
    if (from >= rows || to >= rows) return;  // checked on the host; never out of bounds regardless
    copy_row(base + to * width, base + from * width, width);
}

// Compaction (FOCUS: a launch's tokens to the kept ones of every request): out_s[i] =
// src_s[index[i]] for up to four row-major sources of one dtype (hidden states, queries, RoPE
// cos and sin; width 0 = unused slot), one block per output row. Indices are checked on the
// host; an index >= rows still never reads out of bounds (its output row is zero-filled).
template <typename T>
__device__ void compact_rows(T *d0, const T *s0, int w0, T *d1, const T *s1, int w1, T *d2, const T *s2, int w2,
                             T *d3, const T *s3, int w3, const uint32_t *__restrict__ index, long long rows) {
    const long long i = blockIdx.x;
    const long long src = index[i];
    T *const dst[4] = {d0, d1, d2, d3};
    const T *const srcs[4] = {s0, s1, s2, s3};
    const int widths[4] = {w0, w1, w2, w3};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int w = widths[k];
        if (w <= 0) continue;
        if (src < rows) {
            copy_row(dst[k] + i * w, srcs[k] + src * w, w);
        } else {
            for (int e = threadIdx.x; e < w; e += blockDim.x) dst[k][i * w + e] = from_f<T>(0.f);
        }
    }
}

// Calls visit(v, x) for this thread's logits of `row` ([width]), v = threadIdx.x, + blockDim.x,
// … in increasing index order, so a strict > in `visit` keeps the thread's first maximum. 16-byte
// loads when the row allows: a row of a 150k vocabulary is 300 KB, and 2-byte loads kept too
// few bytes in flight to stream the logits at the memory bandwidth.
template <typename T, int UNROLL, class Visit>
__device__ __forceinline__ void visit_row(const T *__restrict__ row, int width, Visit &visit) {
    constexpr int V = 16 / sizeof(T);
    if ((uintptr_t)row % 16 == 0 && width % V == 0) {
        const uint4 *rv = reinterpret_cast<const uint4 *>(row);
#pragma unroll UNROLL
        for (int c = threadIdx.x; c < width / V; c += blockDim.x) {
            const uint4 raw = rv[c];
            const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
            for (int k = 0; k < V; ++k) visit(c * V + k, to_f(e[k]));
        }
    } else {
        for (int v = threadIdx.x; v < width; v += blockDim.x) visit(v, to_f(row[v]));
    }
}

// Merges every thread's (m, s, a) with merge(m, s, a, m2, s2, a2) across its warp, then across
// the block's warps in order; thread 0 ends with the block's. blockDim.x a multiple of 32. Once
// per kernel: no barrier follows thread 0's reads of the shared arrays.
template <class Merge>
__device__ __forceinline__ void block_merge(float &m, float &s, int &a, Merge merge) {
    __shared__ float s_m[32], s_s[32];
    __shared__ int s_i[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        const int a2 = __shfl_xor_sync(0xffffffffu, a, o);
        merge(m, s, a, m2, s2, a2);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        s_m[warp] = m;
        s_s[warp] = s;
        s_i[warp] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int warps = blockDim.x / 32;
        for (int w = 1; w < warps; ++w) merge(m, s, a, s_m[w], s_s[w], s_i[w]);
    }
}

// grid (rows), block a multiple of 32. Greedy token and its softmax probability per row of
// logits [rows, vocab]: an online (max, argmax, sum of exp) over the row, ties to the lower
// index, `exclude` (the mask token; -1 for none) never chosen and left out of the sum.
// prob = 1 / sum(exp(l - max)).
template <typename T>
__device__ void greedy_confidence(uint32_t *__restrict__ tokens, float *__restrict__ conf,
                                  const T *__restrict__ logits, int vocab, int exclude) {
    const T *row = logits + (long long)blockIdx.x * vocab;
    float m = -INFINITY, sum = 0.f;
    int arg = 0x7fffffff;
    auto visit = [&](int v, float x) {
        if (v == exclude || !(x > -INFINITY)) return;  // -inf (and NaN) logits carry no probability
        if (x > m) {
            sum = sum * expf(m - x) + 1.f;
            m = x;
            arg = v;
        } else {
            sum += expf(x - m);
        }
    };
    visit_row<T, 2>(row, vocab, visit);
    block_merge(m, sum, arg, [](float &m, float &s, int &a, float m2, float s2, int a2) {
        if (m2 == -INFINITY) return;
        if (m == -INFINITY) { m = m2; s = s2; a = a2; return; }
        const float mx = fmaxf(m, m2);
        s = s * expf(m - mx) + s2 * expf(m2 - mx);
        if (m2 > m || (m2 == m && a2 < a)) a = a2;
        m = mx;
    });
    if (threadIdx.x == 0) {
        tokens[blockIdx.x] = arg == 0x7fffffff ? 0u : (uint32_t)arg;
        conf[blockIdx.x] = sum > 0.f ? 1.f / sum : 0.f;
    }
}

// grid (rows), block a multiple of 32. The greedy id of each row of `logits` [rows, width] —
// its first maximum; NaN is never chosen, a row of -inf / NaN gives 0 — and the same id plus
// `flag` where the row's f32 sum is not finite (it holds a NaN or an infinity): one pass instead
// of candle's argmax (per-element 64-bit index arithmetic, ~60 us for 16 rows of a 49k
// vocabulary on the H200) and the sum, compare, cast and add of `ops::flag_non_finite`.
template <typename T>
__device__ void greedy_flagged(uint32_t *__restrict__ ids, uint32_t *__restrict__ flagged,
                               const T *__restrict__ logits, int width, unsigned flag) {
    const T *row = logits + (long long)blockIdx.x * width;
    float m = -INFINITY, sum = 0.f;
    int arg = 0x7fffffff;
    auto visit = [&](int v, float x) {
        sum += x;
        if (x > m) {
            m = x;
            arg = v;
        }
    };
    visit_row<T, 4>(row, width, visit);
    // The larger value wins; equal values go to the lower index (the row's first maximum).
    block_merge(m, sum, arg, [](float &m, float &s, int &a, float m2, float s2, int a2) {
        s += s2;
        if (m2 > m || (m2 == m && a2 < a)) {
            m = m2;
            a = a2;
        }
    });
    if (threadIdx.x == 0) {
        const uint32_t id = arg == 0x7fffffff ? 0u : (uint32_t)arg;
        ids[blockIdx.x] = id;
        flagged[blockIdx.x] = isfinite(sum) ? id : id + flag;
    }
}

} // namespace

#define FUSED_OPS(T, SUF)                                                                          \
    extern "C" __global__ void qkv_rope_write_##SUF(                                               \
        T *q_out, T *k_cache, T *v_cache, const T *qkv, const T *cos_t, const T *sin_t,            \
        const uint32_t *slots, int heads, int kv_heads, int head_dim, long long num_slots) {       \
        qkv_rope_write<T>(q_out, k_cache, v_cache, qkv, cos_t, sin_t, slots, heads, kv_heads,      \
                          head_dim, num_slots);                                                    \
    }                                                                                              \
    extern "C" __global__ void qkv_bias_rope_i_write_##SUF(                                        \
        T *q_out, T *k_cache, T *v_cache, const T *qkv, const T *bias_q, const T *bias_k,          \
        const T *cos_t, const T *sin_t, const uint32_t *slots, int heads, int kv_heads,            \
        int head_dim, long long num_slots) {                                                       \
        qkv_bias_rope_i_write<T>(q_out, k_cache, v_cache, qkv, bias_q, bias_k, cos_t, sin_t,       \
                                 slots, heads, kv_heads, head_dim, num_slots);                     \
    }                                                                                              \
    extern "C" __global__ void qkv_norm_rope_write_##SUF(                                          \
        T *q_out, T *k_out, T *v_out, T *k_cache, T *v_cache, const T *qkv, const T *q_w,          \
        const T *k_w, int has_norm, const T *cos_t, const T *sin_t, const uint32_t *slots,         \
        int heads, int kv_heads, int head_dim, float eps, long long num_slots) {                   \
        qkv_norm_rope_write<T>(q_out, k_out, v_out, k_cache, v_cache, qkv, q_w, k_w, has_norm,     \
                               cos_t, sin_t, slots, heads, kv_heads, head_dim, eps, num_slots);    \
    }                                                                                              \
    extern "C" __global__ void ROW_NORM_BOUNDS add_rms_norm_##SUF(T *h_out, T *n_out, const T *res, const T *x,    \
                                                  const T *w_x, const T *w_next, int ncols,        \
                                                  float eps) {                                     \
        add_rms_norm<T, false>(h_out, n_out, res, Plain<T>{x}, w_x, w_next, ncols, eps);           \
    }                                                                                              \
    extern "C" __global__ void ROW_NORM_BOUNDS add_rms_norm_parts_##SUF(T *h_out, T *n_out, const T *res,          \
                                                        const float *parts, long long part_stride, \
                                                        int nparts, const T *w_x, const T *w_next, \
                                                        int ncols, float eps) {                    \
        add_rms_norm<T, false>(h_out, n_out, res, Parts<T>{parts, part_stride, nparts}, w_x,       \
                               w_next, ncols, eps);                                                \
    }                                                                                              \
    extern "C" __global__ void ROW_NORM_BOUNDS post_norm_##SUF(T *h_out, T *n_out, const T *res, const T *x,       \
                                                  const T *w, const T *w_next, int ncols,          \
                                                  float eps) {                                     \
        add_rms_norm<T, true>(h_out, n_out, res, Plain<T>{x}, w, w_next, ncols, eps);              \
    }                                                                                              \
    extern "C" __global__ void ROW_NORM_BOUNDS post_norm_parts_##SUF(T *h_out, T *n_out, const T *res,             \
                                                        const float *parts, long long part_stride, \
                                                        int nparts, const T *w, const T *w_next,   \
                                                        int ncols, float eps) {                    \
        add_rms_norm<T, true>(h_out, n_out, res, Parts<T>{parts, part_stride, nparts}, w, w_next,  \
                              ncols, eps);                                                         \
    }                                                                                              \
    extern "C" __global__ void ROW_NORM_BOUNDS rms_norm_##SUF(T *n_out, const T *x, const T *w, int ncols, float eps) { \
        rms_norm_rows<T, false>(nullptr, n_out, nullptr, Plain<T>{x}, w, ncols, eps);              \
    }                                                                                              \
    extern "C" __global__ void ROW_NORM_BOUNDS add_rms_norm_pre_##SUF(T *h_out, T *n_out, const T *res, const T *x, \
                                                      const T *w, int ncols, float eps) {          \
        rms_norm_rows<T, true>(h_out, n_out, res, Plain<T>{x}, w, ncols, eps);                     \
    }                                                                                              \
    extern "C" __global__ void ROW_NORM_BOUNDS add_rms_norm_pre_parts_##SUF(T *h_out, T *n_out, const T *res,      \
                                                            const float *parts,                    \
                                                            long long part_stride, int nparts,     \
                                                            const T *w, int ncols, float eps) {    \
        rms_norm_rows<T, true>(h_out, n_out, res, Parts<T>{parts, part_stride, nparts}, w, ncols,  \
                               eps);                                                               \
    }                                                                                              \
    extern "C" __global__ void residual_add_##SUF(T *out, const T *a, const T *b, long long n) {    \
        residual_add<T>(out, a, b, n);                                                             \
    }                                                                                              \
    extern "C" __global__ void silu_mul_##SUF(T *out, const T *gu, long long rows, int inter) {    \
        silu_mul<T>(out, gu, rows, inter);                                                         \
    }                                                                                              \
    extern "C" __global__ void rope_angles_##SUF(T *cos_out, T *sin_out, const uint32_t *pos,      \
                                                 const float *inv_freq, long long tokens,          \
                                                 int half) {                                       \
        rope_angles<T>(cos_out, sin_out, pos, inv_freq, tokens, half);                             \
    }                                                                                              \
    extern "C" __global__ void scatter_rows_##SUF(T *dst, const T *src, const uint32_t *index,     \
                                                  int width, long long dst_rows) {                 \
        scatter_rows<T>(dst, src, index, width, dst_rows);                                         \
    }                                                                                              \
    extern "C" __global__ void row_dot_f32_##SUF(float *out, const T *h, const float *w,           \
                                                 const float *bias, int k) {                       \
        row_dot_f32<T>(out, h, w, bias, k);                                                        \
    }                                                                                              \
    extern "C" __global__ void latent_change_##SUF(float *out, const T *old_s, const T *new_s,      \
                                                   int cols, long long stride) {                   \
        latent_change<T>(out, old_s, new_s, cols, stride);                                         \
    }                                                                                              \
    extern "C" __global__ void gather_rows_##SUF(T *dst, const T *src, const uint32_t *index,      \
                                                 int width, long long src_rows) {                  \
        gather_rows<T>(dst, src, index, width, src_rows);                                          \
    }                                                                                              \
    extern "C" __global__ void gather_rows_scaled_##SUF(T *dst, const T *src, const uint32_t *index, \
                                                        int width, long long src_rows,             \
                                                        float scale) {                             \
        gather_rows_scaled<T>(dst, src, index, width, src_rows, scale);                            \
    }                                                                                              \
    extern "C" __global__ void copy_rows_in_place_##SUF(const unsigned long long *bases,          \
                                                        const uint32_t *src, const uint32_t *dst,  \
                                                        int width, long long rows) {               \
        copy_rows_in_place<T>(bases, src, dst, width, rows);                                       \
    }                                                                                              \
    extern "C" __global__ void compact_rows_##SUF(T *d0, const T *s0, int w0, T *d1, const T *s1,  \
                                                  int w1, T *d2, const T *s2, int w2, T *d3,       \
                                                  const T *s3, int w3, const uint32_t *index,      \
                                                  long long rows) {                                \
        compact_rows<T>(d0, s0, w0, d1, s1, w1, d2, s2, w2, d3, s3, w3, index, rows);              \
    }                                                                                              \
    extern "C" __global__ void greedy_confidence_##SUF(uint32_t *tokens, float *conf,              \
                                                       const T *logits, int vocab, int exclude) {  \
        greedy_confidence<T>(tokens, conf, logits, vocab, exclude);                                \
    }                                                                                              \
    extern "C" __global__ void __launch_bounds__(1024)                                             \
        greedy_flagged_##SUF(uint32_t *ids, uint32_t *flagged,                                     \
                                                    const T *logits, int width, unsigned flag) {   \
        greedy_flagged<T>(ids, flagged, logits, width, flag);                                      \
    }

FUSED_OPS(float, f32)
FUSED_OPS(__nv_bfloat16, bf16)
FUSED_OPS(__half, f16)
