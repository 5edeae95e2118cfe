// Dense 16-bit linear layers at decode widths (ponder): y = x · Wᵀ for x [M, K] (M ≤ 64) and
// W [N, K] in T (bf16, f16), f32 sums; the output either rounded to T, or as f32 partial products
// over `splits` equal slices of k ([splits, M, N], what a split-k projection's norm sums). At
// these widths a layer is a stream of its weights, each read once; what bounds it is how many of
// their bytes are in flight, so every warp keeps STAGES - 1 chunks of its weights loading into a
// ring of shared memory (cp.async) while it multiplies one on the tensor cores (mma.sync
// m16n8k16). cuBLAS's kernels at these shapes read 1.7–2.3 TB/s on an H100 (ncu,
// docs/bench/fp8/h100_weight_only_ncu_3348732.json): this is the alternative to that.
//
// stream_gemm_m{1,2,4}_*: 16, 32, 64 rows in MT m16 tiles. Block (x, y): 16 output columns
// (two n8 tiles) of slice y of k, each of its 8 warps a contiguous run of 64-wide chunks of the
// slice, summed through shared memory at the end. A warp copies a chunk's 16 rows × 128 bytes
// into its ring in whole lines, then each lane reads back 32 contiguous bytes (16 values) of one
// weight row of each tile (column g of its quad group); since a dot product does not care about
// the order of k, each mma step's logical k 2t, 2t+1, 2t+8, 2t+9 (lane t of a quad) is mapped to
// that lane's values 4s .. 4s+3, and x's fragments are loaded under the same map (rows g and
// g + 8 of each m16 tile, from L1: every block reads all of its slice of x).
// Rows past x's, columns past N and k past the slice are zero. K and the slice width must be
// multiples of 8 and x, W 16-byte aligned (checked by the launcher). Launched with SMEM_BYTES of
// dynamic shared memory (the launcher's STREAM_GEMM_SMEM_BYTES, held equal by a test).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cp_async.cuh"
#include "floats.cuh"
#include "mma.cuh"
#include "mma_reduce.cuh"

namespace {

constexpr int WARPS = 8;                            // a block's warps, each a share of its slice
constexpr int TILES = 2;                            // n8 tiles: 16 output columns a block
constexpr int STAGES = 3;                           // chunks a warp's ring holds
constexpr int LANE_BYTES = 32;                      // a lane's values of one tile in a chunk
constexpr int CHUNK_BYTES = TILES * 32 * LANE_BYTES; // a warp's chunk: 2 KB
constexpr int SMEM_BYTES = WARPS * STAGES * CHUNK_BYTES;

template <typename T, int MT>
__device__ void stream_gemm(void *out, const T *x, const T *w, int rows, int n, int k, int slice, int f32_out) {
    extern __shared__ __align__(16) unsigned char ring_smem[];
    static_assert(WARPS * MT * TILES * 4 * 32 * sizeof(float) <= SMEM_BYTES, "partial sums fit the rings");
    const int l = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = l / 4, t = l % 4;
    const int col0 = blockIdx.x * 8 * TILES;
    const long long k0 = (long long)blockIdx.y * slice;
    const int extent = min((long long)slice, k - k0); // this block's k
    const T *xlo[MT], *xhi[MT];
    bool lo_ok[MT], hi_ok[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        lo_ok[m] = 16 * m + g < rows;
        hi_ok[m] = 16 * m + g + 8 < rows;
        xlo[m] = x + (long long)(lo_ok[m] ? 16 * m + g : 0) * k + k0;
        xhi[m] = x + (long long)(hi_ok[m] ? 16 * m + g + 8 : 0) * k + k0;
    }
    const int chunks = (extent + 63) / 64;
    // This warp's chunks: a contiguous run of them, so that it walks along its rows of W.
    const int per = (chunks + WARPS - 1) / WARPS;
    const int first = warp * per;
    const int mine = max(0, min(chunks, first + per) - first);
    const unsigned ring = static_cast<unsigned>(__cvta_generic_to_shared(ring_smem)) + warp * STAGES * CHUNK_BYTES;
    const unsigned char *ring_ptr = ring_smem + warp * STAGES * CHUNK_BYTES;
    // This lane's first value of its chunk i (in the mma map: lane t of a quad takes 16 values).
    auto chunk_k = [&](int i) { return (first + i) * 64 + 16 * t; };
    // Chunk i (16 rows of W × 64 values, 128 bytes a row) into its slot, coalesced: the warp's
    // lanes copy 16-byte pieces p = lane + 32q, piece p being segment p % 8 of row p / 8, so
    // that each copy instruction reads four whole 128-byte lines. Segments sit at s ^ (row & 1)
    // in the slot: the mma-map reads below then hit distinct banks. Zero past the slice or N.
    auto issue = [&](int i) {
        const int kc = (first + i) * 64;
        const unsigned slot = ring + (i % STAGES) * CHUNK_BYTES;
#pragma unroll
        for (int q = 0; q < CHUNK_BYTES / (32 * 16); ++q) {
            const int p = l + 32 * q, r = p / 8, sg = p % 8;
            const bool ok = col0 + r < n && kc + 8 * sg < extent;
            const T *src = w + (long long)(col0 + r) * k + k0 + kc + 8 * sg;
            cp_async16(slot + r * 128 + ((sg ^ (r & 1)) * 16), ok ? src : w, ok);
        }
    };
    float acc[MT][TILES][4] = {};
    // One commit a chunk, empty past this warp's last, so that the wait counts groups the same
    // way at every step.
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < mine) issue(i);
        cp_async_commit();
    }
    for (int i = 0; i < mine; ++i) {
        cp_async_wait<STAGES - 2>(); // this lane's copies of chunk i have landed
        __syncwarp();                // and every lane's: each reads pieces others copied
        const int kk = chunk_k(i);
        // This lane's 16 values of its row 8j + g of each tile (segments 2t, 2t + 1).
        uint4 wv[TILES][2];
#pragma unroll
        for (int j = 0; j < TILES; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = 8 * j + g, sg = 2 * t + h;
                wv[j][h] = *reinterpret_cast<const uint4 *>(ring_ptr + (i % STAGES) * CHUNK_BYTES + r * 128 + ((sg ^ (r & 1)) * 16));
            }
        // Refill the slot read last step (every lane past the barrier above) with chunk
        // i + STAGES - 1.
        if (i + STAGES - 1 < mine) issue(i + STAGES - 1);
        cp_async_commit();
        // x's 16 values at kk.. of rows g and g + 8 of each m tile; zero past rows or the slice.
        uint4 xl[MT][2], xh[MT][2];
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const bool in = kk + 8 * h < extent;
                xl[m][h] = lo_ok[m] && in ? __ldg(reinterpret_cast<const uint4 *>(xlo[m] + kk + 8 * h)) : make_uint4(0, 0, 0, 0);
                xh[m][h] = hi_ok[m] && in ? __ldg(reinterpret_cast<const uint4 *>(xhi[m] + kk + 8 * h)) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            // Step s multiplies the lane's values 4s .. 4s + 3 (words 2s, 2s + 1): logical k 2t,
            // 2t + 1 are its first pair, 2t + 8, 2t + 9 its second (the same map for x and W).
#pragma unroll
            for (int j = 0; j < TILES; ++j) {
                const uint32_t *wj = reinterpret_cast<const uint32_t *>(wv[j]);
                const uint32_t b[2] = {wj[2 * s], wj[2 * s + 1]};
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const uint32_t *lo = reinterpret_cast<const uint32_t *>(xl[m]);
                    const uint32_t *hi = reinterpret_cast<const uint32_t *>(xh[m]);
                    const uint32_t a[4] = {lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1]};
                    mma16816<T>(acc[m][j], a, b);
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads(); // every warp done with its ring before the rings hold partial sums
    // The warps' shares summed through the rings.
    reduce_fragments<WARPS, MT, TILES>(acc, reinterpret_cast<float *>(ring_smem), col0, rows, n, [&](int row, int col, float v) {
        const long long at = (long long)row * n + col;
        if (f32_out)
            static_cast<float *>(out)[(long long)blockIdx.y * rows * n + at] = v;
        else
            static_cast<T *>(out)[at] = from_f<T>(v);
    });
}

} // namespace

#define STREAM_GEMM_KERNEL(T, SUF, MT)                                                                    \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                                              \
        stream_gemm_m##MT##_##SUF(void *out, const T *x, const T *w, int rows, int n, int k, int slice,   \
                                  int f32_out) {                                                          \
        stream_gemm<T, MT>(out, x, w, rows, n, k, slice, f32_out);                                        \
    }

STREAM_GEMM_KERNEL(__nv_bfloat16, bf16, 1)
STREAM_GEMM_KERNEL(__nv_bfloat16, bf16, 2)
STREAM_GEMM_KERNEL(__nv_bfloat16, bf16, 4)
STREAM_GEMM_KERNEL(__half, f16, 1)
STREAM_GEMM_KERNEL(__half, f16, 2)
STREAM_GEMM_KERNEL(__half, f16, 4)
