// Decode-width GEMM: y[M, N] = x[M, K] · w[N, K]ᵀ for M ≤ 64 rows (bf16 / f16, f32 accumulation).
//
// At decode widths a projection reads each weight once and does M multiply-adds with it, so the
// kernel's job is to keep enough of w in flight to run at the copy bandwidth. Loads through the
// SMs' load units (16 bytes a thread into registers) did not: about 2 TB/s whatever the depth,
// below cuBLAS. So each warp streams its 16 weight rows with the copy engine (`cp.async.bulk`,
// one 128-byte row piece per lane) into a ring of `NS` chunk slots in shared memory, completion
// counted on an mbarrier per slot, and refills a slot as soon as its MMAs have read it. The MMA's
// k order is a permutation of the chunk's: a thread's eight k feed two m16n8k16 steps, and the x
// fragments are read with the same permutation, so the dot products are exact sums over the
// same k.
//
// Layout of the work: a block of `WARPS` warps owns `WARPS * 16` output columns (a warp two
// 8-column MMA tiles) over one slice of k; the x slice of the block is staged in shared memory
// once (cp.async, one round trip, while the first weight chunks are already in flight). When the
// columns alone give too few blocks, k is split over the S blocks of a thread-block cluster
// (Hopper): each leaves its f32 partials in its shared memory, and after a cluster barrier each
// block adds up a share of the rows from all S blocks' shared memory in rank order — the same
// order every run — and writes the output. No global workspace, no atomics, one launch.
//
// With `silu_pairs` = I (the fused gate/up projection, gate rows first), a warp's two tiles are
// gate columns [c, c+8) and the matching up columns [I+c, I+c+8), and the output is
// silu(gate) · up, `[M, I]`: the SiLU·mul epilogue costs no extra launch and no round trip.
//
// A row's result does not depend on the other rows: every row is its own MMA row, and the k
// order is fixed by the split count, which the host chooses from (N, K, the row-tile count).
//
// Needs sm_90 (clusters); the host uses the kernel only on sm_90 builds.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace cg = cooperative_groups;

namespace {

constexpr int WARPS = 8;   // per block
constexpr int CHUNK = 64;  // k per pipeline step: two 16-byte loads per weight row and thread
constexpr int NS = 3;      // chunks of w in flight per warp: a ring of bulk copies into shared memory
constexpr int ROWB = 192;  // bytes per weight row in a ring slot: 128 of data, rows g and g + 1 on other banks
constexpr int SLOT = 16 * ROWB;  // one warp's chunk: its 16 weight rows
constexpr int PAD = 32;    // elements after each staged x row: rows start 64 bytes apart mod 128

template <typename T> __device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <> __device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

// 16 bytes global -> shared, bypassing L1; `valid` false writes zeros (nothing is read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(unsigned bar) { asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar)); }

__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred ready;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
        "@!ready bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// `bytes` (a multiple of 16) global -> shared by the copy engine, counted on `bar`.
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Queues chunk `c` of the warp's 16 weight rows into ring slot `slot`: lane 0 announces the
// bytes, lanes 0..15 copy a row each.
template <typename T>
__device__ __forceinline__ void issue_chunk(unsigned ring, unsigned bars, int slot, const T* my_row, int lane, int k, int K) {
    const unsigned bar = bars + 8 * slot;
    const unsigned bytes = 2 * min(CHUNK, K - k);
    if (lane == 0) mbar_expect_tx(bar, 16 * bytes);
    __syncwarp();
    if (lane < 16) bulk_copy(ring + slot * SLOT + lane * ROWB, my_row + k, bytes, bar);
}

// acc[i][j] += x rows of m-tile i · the chunk of tile j, from staged x at local k `lk` (+ 8t).
template <typename T, int MT>
__device__ __forceinline__ void mma_chunk(float (&acc)[MT][2][4], const uint4 (&w)[2][2], const T* xs, int stride, int g, int lk) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const T* r0 = xs + (16 * i + g) * stride + lk;
        const T* r8 = r0 + 8 * stride;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 lo = *reinterpret_cast<const uint4*>(r0 + 32 * h);
            const uint4 hi = *reinterpret_cast<const uint4*>(r8 + 32 * h);
            const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y};
            const uint32_t a1[4] = {lo.z, hi.z, lo.w, hi.w};
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                mma16816<T>(acc[i][j], a0, w[j][h].x, w[j][h].y);
                mma16816<T>(acc[i][j], a1, w[j][h].z, w[j][h].w);
            }
        }
    }
}

// Writes a thread's outputs: rows 16i + g (+8), columns 2t, 2t+1 of each tile; with silu
// pairs, silu(tile 0) · tile 1 at the gate columns.
template <typename T, int MT>
__device__ __forceinline__ void store_out(T* y, const float (&acc)[MT][2][4], int M, int ldy, int col0, int col1, bool silu_pairs, int g) {
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = 16 * i + g + 8 * half;
            if (row >= M) continue;
            T* yr = y + (size_t)row * ldy;
            const float* a = acc[i][0] + 2 * half;
            const float* b = acc[i][1] + 2 * half;
            if (silu_pairs) {
                *reinterpret_cast<uint32_t*>(yr + col0) = pack2<T>(silu(a[0]) * b[0], silu(a[1]) * b[1]);
            } else {
                *reinterpret_cast<uint32_t*>(yr + col0) = pack2<T>(a[0], a[1]);
                *reinterpret_cast<uint32_t*>(yr + col1) = pack2<T>(b[0], b[1]);
            }
        }
    }
}

template <typename T, int MT, int S>
__device__ void skinny_gemm(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w, int M, int N, int K, int chunks_per_split,
                            int silu_pairs) {
    extern __shared__ __align__(16) unsigned char smem_raw[];

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const int split = blockIdx.y;
    const int nchunks = (K + CHUNK - 1) / CHUNK;
    const int c_begin = split * chunks_per_split;
    const int my_chunks = max(0, min(chunks_per_split, nchunks - c_begin));
    const int k_begin = c_begin * CHUNK;
    const int stride = chunks_per_split * CHUNK + PAD;

    // The warp's two weight rows (for this thread: row g of each tile) and its output columns.
    const int pairs = silu_pairs;
    const int out_n = pairs ? pairs : N;
    const int group_cols = WARPS * (pairs ? 8 : 16);
    const int col = blockIdx.x * group_cols + warp * (pairs ? 8 : 16);
    const bool live = col < out_n;
    const int row0 = col + g, row1 = pairs ? pairs + col + g : col + 8 + g;

    // Shared memory: each warp's ring of weight chunks, then x's k slice, then the ring barriers.
    unsigned char* ring_w = smem_raw + warp * NS * SLOT;
    T* xs = reinterpret_cast<T*>(smem_raw + WARPS * NS * SLOT);
    unsigned long long* bar_base = reinterpret_cast<unsigned long long*>(smem_raw + WARPS * NS * SLOT + ((16 * MT * stride * 2 + 15) / 16) * 16);
    const unsigned ring = smem_addr(ring_w), bars = smem_addr(bar_base + warp * NS);

    // Zero the ring (a last chunk short of 64 k leaves the rest of its rows as they were: zeros
    // or finite weights, times x's zeros) and start the warp's copies.
    for (int i = lane; i < NS * SLOT / 16; i += 32) reinterpret_cast<uint4*>(ring_w)[i] = make_uint4(0, 0, 0, 0);
    if (lane == 0)
        for (int s = 0; s < NS; ++s) mbar_init(bars + 8 * s);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncwarp();
    const int r = lane % 16;
    const T* my_row = w + (size_t)(live ? (r < 8 ? row0 - g + r : row1 - g + r - 8) : 0) * K;
    if (live)
        for (int c = 0; c < min(NS, my_chunks); ++c) issue_chunk<T>(ring, bars, c, my_row, lane, k_begin + CHUNK * c, K);

    // Stage x[:, k slice] (zeros past M and K) with cp.async while the weights stream.
    const int vec_per_row = stride / 8;
    for (int v = threadIdx.x; v < 16 * MT * vec_per_row; v += blockDim.x) {
        const int xr = v / vec_per_row, kv = (v % vec_per_row) * 8, k = k_begin + kv;
        const bool valid = xr < M && kv < my_chunks * CHUNK && k < K;
        cp_async16(xs + xr * stride + kv, valid ? x + (size_t)xr * K + k : x, valid);
    }
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();

    float acc[MT][2][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    if (live) {
        for (int c = 0; c < my_chunks; ++c) {
            const int slot = c % NS;
            mbar_wait(bars + 8 * slot, (c / NS) & 1);
            uint4 wv[2][2];
            const unsigned char* sw = ring_w + slot * SLOT + g * ROWB + 16 * t;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) wv[j][h] = *reinterpret_cast<const uint4*>(sw + 8 * j * ROWB + 64 * h);
            mma_chunk<T, MT>(acc, wv, xs, stride, g, CHUNK * c + 8 * t);
            // The slot's values are in registers (consumed above); refill it.
            __syncwarp();
            if (c + NS < my_chunks) {
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                issue_chunk<T>(ring, bars, slot, my_row, lane, k_begin + CHUNK * (c + NS), K);
            }
        }
    }

    const int col0 = col + 2 * t, col1 = col + 8 + 2 * t;
    if constexpr (S == 1) {
        if (live) store_out<T, MT>(y, acc, M, out_n, col0, col1, pairs != 0, g);
    } else {
        // Partials [M][WARPS * 16] f32 in this block's shared memory, where the rings were.
        constexpr int GC = WARPS * 16;
        float* part = reinterpret_cast<float*>(smem_raw);
        __syncthreads();
        if (live) {
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = 16 * i + g + 8 * half;
                    if (row >= M) continue;
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        *reinterpret_cast<float2*>(part + row * GC + warp * 16 + 8 * j + 2 * t) = make_float2(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
                }
        }
        cg::cluster_group cluster = cg::this_cluster();
        cluster.sync();
        // Block `rank` of the cluster finishes rows rank, rank + S, ...: each thread a pair of
        // output columns of one row, summing the S partials in rank order.
        const int rank = static_cast<int>(cluster.block_rank());
        const int col_pairs = group_cols / 2;
        const int group_col0 = blockIdx.x * group_cols;
        for (int e = threadIdx.x;; e += blockDim.x) {
            const int row = rank + S * (e / col_pairs);
            if (row >= M) break;
            const int oc = 2 * (e % col_pairs);
            if (group_col0 + oc >= out_n) continue;
            // Where output column oc's partials sit: gate (and up, 8 further) in silu mode.
            const int lcol = pairs ? (oc / 8) * 16 + oc % 8 : oc;
            float2 a = make_float2(0.f, 0.f), b = make_float2(0.f, 0.f);
#pragma unroll
            for (int s = 0; s < S; ++s) {
                const float* p = cluster.map_shared_rank(part, s) + row * GC + lcol;
                const float2 pa = *reinterpret_cast<const float2*>(p);
                a.x += pa.x;
                a.y += pa.y;
                if (pairs) {
                    const float2 pb = *reinterpret_cast<const float2*>(p + 8);
                    b.x += pb.x;
                    b.y += pb.y;
                }
            }
            T* yr = y + (size_t)row * out_n + group_col0 + oc;
            *reinterpret_cast<uint32_t*>(yr) = pairs ? pack2<T>(silu(a.x) * b.x, silu(a.y) * b.y) : pack2<T>(a.x, a.y);
        }
        // Peers read this block's shared memory until here.
        cluster.sync();
    }
}

}  // namespace

#define SKINNY(TYPE, SUF, MT, S)                                                                                            \
    extern "C" __global__ void __cluster_dims__(1, S, 1) __launch_bounds__(WARPS * 32) skinny_gemm_##SUF##_m##MT##_s##S( \
        TYPE* y, const TYPE* x, const TYPE* w, int M, int N, int K, int chunks_per_split, int silu_pairs) {                \
        skinny_gemm<TYPE, MT, S>(y, x, w, M, N, K, chunks_per_split, silu_pairs);                                           \
    }
#define SKINNY_SPLITS(TYPE, SUF, MT) \
    SKINNY(TYPE, SUF, MT, 1)         \
    SKINNY(TYPE, SUF, MT, 2)         \
    SKINNY(TYPE, SUF, MT, 4)         \
    SKINNY(TYPE, SUF, MT, 8)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
SKINNY_SPLITS(__nv_bfloat16, bf16, 1)
SKINNY_SPLITS(__nv_bfloat16, bf16, 2)
SKINNY_SPLITS(__nv_bfloat16, bf16, 4)
SKINNY_SPLITS(__half, f16, 1)
SKINNY_SPLITS(__half, f16, 2)
SKINNY_SPLITS(__half, f16, 4)
#endif
