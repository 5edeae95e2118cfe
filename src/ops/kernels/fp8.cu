// Weight-only FP8 linear layers at decode widths (ponder): y = x · Wᵀ (+ b) for x [M, K] in T
// (M ≤ FP8_MAX_ROWS) and W [N, K] in E4M3 with one f32 scale per output row. Each weight is
// dequantized as the reference dequantizes it, T(e4m3 · scale), and the products are summed in
// f32; the output is rounded to T and the bias added after that rounding (candle's Linear:
// matmul, then the broadcast add). At these widths the layer is memory-bound and reads a byte a
// weight, half of bf16's.
//
// fp8_linear_mma_* (bf16, f16): the tensor-core kernel, for up to FP8_MMA_MAX_ROWS rows in MT
// m16 tiles (fp8_linear_mma_m{1,2,4}_*: 16, 32, 64 rows; every converted weight fragment feeds
// MT mma steps). At 16 rows a weight byte feeds 32 FLOPs, which SIMT FMAs cannot keep up with at
// HBM speed; mma.sync m16n8k16 can. A block takes
// 16 output columns (two n8 tiles), its 8 warps interleaved 64-wide chunks of k, summed through
// shared memory at the end. A lane loads 16 contiguous weight bytes of one W row a chunk (one
// 16-byte load), converts them exactly to T (E4M3 ⊂ f16 ⊂ bf16's range and precision) and feeds
// four mma steps; since a dot product does not care about the order of k, each step's logical
// k 2t, 2t+1, 2t+8, 2t+9 (lane t of a quad) is mapped to that lane's bytes 4s .. 4s+3, and x's
// fragments are loaded under the same map (two 16-byte loads a row, from L1: every block reads
// all of x). Rows of an m16 tile past x's are zero (not loaded). The row scale
// multiplies the f32 sum, not each weight: the reference rounds T(e4m3 · scale) per weight, so
// the two differ by that rounding (≤ 2⁻⁹ relative a weight in bf16), not by the order of sums
// alone. Block-scaled weights (a scale per tile of W, as DeepSeek-style checkpoints store them)
// are multiplied by their tile's scale as they are converted, T(e4m3 · scale) as the reference.
// fp8_linear_mma_pipe_m{1,2,4}_*: the same lanes and sums by persistent blocks, each warp's
// weights streamed through a ring of shared memory (cp.async) across the tiles its block takes,
// so that loads stay in flight while it multiplies; launched with PIPE_SMEM_BYTES of dynamic
// shared memory (the ring and the partial sums) and as many blocks as the GPU holds at once.
//
// fp8_linear_* (f32, and the reference order for the 16-bit dtypes): one warp per output row
// (8 rows a block); each lane takes 16 weights at a time, one 16-byte load, and applies them to
// every row of x (x is small and stays in L1 / L2).
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
#define FP8_MMA_MAX_ROWS 64

#include "cp_async.cuh"
#include "floats.cuh"
#include "mma.cuh"
#include "mma_reduce.cuh"

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

// Two E4M3 bytes (the low byte first) through the hardware conversion to f16, where E4M3 is
// exact.
__device__ __forceinline__ __half2_raw e4m3x2_half(uint16_t pair) {
    return __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
}

// Two bf16 (f16) values from two E4M3 bytes, the low byte in the low half; f16's values of
// E4M3 are exact in f32 and bf16.
template <typename T> __device__ __forceinline__ uint32_t e4m3x2_to(uint16_t pair);
template <> __device__ __forceinline__ uint32_t e4m3x2_to<__half>(uint16_t pair) {
    const __half2_raw h = e4m3x2_half(pair);
    return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}
template <> __device__ __forceinline__ uint32_t e4m3x2_to<__nv_bfloat16>(uint16_t pair) {
    const float2 f = __half22float2(__half2(e4m3x2_half(pair)));
    __nv_bfloat162 b = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<uint32_t *>(&b);
}

// The same pair dequantized by a block's scale: T(e4m3 · s) each, in f32, as the reference
// rounds a block-scaled weight.
template <typename T> __device__ __forceinline__ uint32_t e4m3x2_scaled(uint16_t pair, float s) {
    const float2 f = __half22float2(__half2(e4m3x2_half(pair)));
    T pr[2] = {from_f<T>(f.x * s), from_f<T>(f.y * s)};
    return *reinterpret_cast<uint32_t *>(pr);
}

// Weights are read once: streamed past L1 so that x, which every block reads, stays there.
__device__ __forceinline__ uint4 load_streaming(const uint8_t *p) { return __ldcs(reinterpret_cast<const uint4 *>(p)); }

constexpr int MMA_WARPS = 8;     // a block's warps, each a share of k
constexpr int MMA_TILES = 2;     // n8 tiles a warp: 16 output columns a block
constexpr int MMA_UNROLL = 4;    // 64-wide chunks of k whose weights a warp loads before using them
constexpr int MMA_COLS = 8 * MMA_TILES;
// The pipelined kernel's shared memory: the 48 KB a launch gets without opting in (the launcher's
// FP8_PIPE_SMEM_BYTES, held equal by a test), its warps' rings of stages (one chunk of 16 columns
// × 64 bytes a stage, 1 KB) and after them the partial sums of a tile (8 KB an m16 tile): five
// stages a ring at 16 rows, four at 32, two at 64.
constexpr int PIPE_STAGES = 6;
constexpr int PIPE_CHUNK_BYTES = MMA_TILES * 32 * 16;
constexpr int PIPE_SMEM_BYTES = MMA_WARPS * PIPE_STAGES * PIPE_CHUNK_BYTES;

// What one lane of the tensor-core kernels reads: its weight row of each n8 tile (one output
// column, g of its quad group) and rows g and g + 8 of x in each m16 tile. `scale`: one per output
// row, applied to the f32 sum; or, with `block_rows` > 0, one per block_rows × block_cols tile of W
// (`[ceil(n / block_rows), ceil(k / block_cols)]`, block_cols a multiple of 16), applied to each
// weight as it is converted.
template <typename T, int MT> struct Fp8MmaLane {
    const uint8_t *wrow[MMA_TILES];
    bool wok[MMA_TILES];
    const T *xlo[MT], *xhi[MT];
    bool lo_ok[MT], hi_ok[MT];
    int g, t, col0, n, k, block_rows, block_cols, scale_cols;
    const float *scale;

    __device__ __forceinline__ Fp8MmaLane(const T *x, const uint8_t *w, const float *scale_, int rows, int n_, int k_,
                                          int block_rows_, int block_cols_) {
        const int lane = threadIdx.x % 32;
        g = lane / 4, t = lane % 4, col0 = blockIdx.x * MMA_COLS, n = n_, k = k_;
        block_rows = block_rows_, block_cols = block_cols_, scale = scale_;
        scale_cols = block_rows > 0 ? (k + block_cols - 1) / block_cols : 0; // block scales a row
#pragma unroll
        for (int j = 0; j < MMA_TILES; ++j) {
            const int c = col0 + 8 * j + g;
            wok[j] = c < n;
            wrow[j] = w + (long long)(wok[j] ? c : 0) * k;
        }
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            lo_ok[m] = 16 * m + g < rows;
            hi_ok[m] = 16 * m + g + 8 < rows;
            xlo[m] = x + (long long)(lo_ok[m] ? 16 * m + g : 0) * k;
            xhi[m] = x + (long long)(hi_ok[m] ? 16 * m + g + 8 : 0) * k;
        }
    }

    // Points the lane at the 16 output columns from c0 (the persistent kernel's next tile).
    __device__ __forceinline__ void at_columns(const uint8_t *w, int c0) {
        col0 = c0;
#pragma unroll
        for (int j = 0; j < MMA_TILES; ++j) {
            const int c = col0 + 8 * j + g;
            wok[j] = c < n;
            wrow[j] = w + (long long)(wok[j] ? c : 0) * k;
        }
    }

    // This lane's first weight of chunk c (64-wide), and whether its tile-j bytes are in W.
    __device__ __forceinline__ int chunk_k(int c) const { return c * 64 + 16 * t; }
    __device__ __forceinline__ bool loads(int j, int kk) const { return wok[j] && kk < k; }

    // One chunk's MMAs: this lane's 16 weight bytes of each tile (`wv`, from k = kk) converted to
    // T and multiplied with x's matching values into acc.
    __device__ __forceinline__ void multiply(float (&acc)[MT][MMA_TILES][4], const uint4 (&wv)[MMA_TILES], int kk) const {
        // x's 16 values at kk.. of rows g and g + 8 of each m tile, as bf16 (f16) pairs; zero
        // past rows or k.
        uint4 xl[MT][2], xh[MT][2];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            xl[m][0] = xl[m][1] = xh[m][0] = xh[m][1] = make_uint4(0, 0, 0, 0);
            if (lo_ok[m] && kk < k) {
                xl[m][0] = __ldg(reinterpret_cast<const uint4 *>(xlo[m] + kk));
                xl[m][1] = __ldg(reinterpret_cast<const uint4 *>(xlo[m] + kk + 8));
            }
            if (hi_ok[m] && kk < k) {
                xh[m][0] = __ldg(reinterpret_cast<const uint4 *>(xhi[m] + kk));
                xh[m][1] = __ldg(reinterpret_cast<const uint4 *>(xhi[m] + kk + 8));
            }
        }
        // A block-scaled W: each tile's scale for this lane's 16 weights (one block of k).
        float bs[MMA_TILES];
        if (block_rows > 0) {
#pragma unroll
            for (int j = 0; j < MMA_TILES; ++j) {
                const int c = min(col0 + 8 * j + g, n - 1);
                bs[j] = scale[(c / block_rows) * scale_cols + min(kk, k - 1) / block_cols];
            }
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            // Step s multiplies the lane's values 4s .. 4s + 3: logical k 2t, 2t + 1 of the
            // mma are its first pair, 2t + 8, 2t + 9 its second (the same map for x and W).
#pragma unroll
            for (int j = 0; j < MMA_TILES; ++j) {
                const uint32_t word = reinterpret_cast<const uint32_t *>(&wv[j])[s];
                const uint16_t p0 = static_cast<uint16_t>(word & 0xffff), p1 = static_cast<uint16_t>(word >> 16);
                uint32_t b[2];
                if (block_rows > 0) {
                    b[0] = e4m3x2_scaled<T>(p0, bs[j]);
                    b[1] = e4m3x2_scaled<T>(p1, bs[j]);
                } else {
                    b[0] = e4m3x2_to<T>(p0);
                    b[1] = e4m3x2_to<T>(p1);
                }
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

    // The warps' shares of k summed through `part` (MMA_WARPS × MT·MMA_TILES·4 × 32 floats of
    // shared memory); then the scale, the rounding to T (where the reference rounds the
    // product) and the bias.
    __device__ __forceinline__ void finish(const float (&acc)[MT][MMA_TILES][4], float *part, T *out, const T *bias, int rows) const {
        reduce_fragments<MMA_WARPS, MT, MMA_TILES>(acc, part, col0, rows, n, [&](int row, int col, float v) {
            float y = round_t<T>(block_rows > 0 ? v : v * scale[col]);
            if (bias != nullptr) y += to_f(bias[col]);
            out[(long long)row * n + col] = from_f<T>(y);
        });
    }

    // `finish` for one k slice of a split product: the scaled f32 sum, unrounded, into slice
    // `blockIdx.y` of `parts` (`[slices, rows, n]`), which the next op sums.
    __device__ __forceinline__ void finish_partial(const float (&acc)[MT][MMA_TILES][4], float *part, float *parts, int rows) const {
        float *slice = parts + (long long)blockIdx.y * rows * n;
        reduce_fragments<MMA_WARPS, MT, MMA_TILES>(acc, part, col0, rows, n, [&](int row, int col, float v) {
            slice[(long long)row * n + col] = block_rows > 0 ? v : v * scale[col];
        });
    }
};

// The 64-wide chunks of k that this block multiplies: all of them, or with a grid of several k
// slices (`gridDim.y`) the y-th of as many equal runs.
__device__ __forceinline__ int2 chunk_range(int k) {
    const int chunks = (k + 63) / 64;
    const int per = (chunks + gridDim.y - 1) / gridDim.y;
    const int begin = min(chunks, (int)blockIdx.y * per);
    return make_int2(begin, min(chunks, begin + per));
}

// `parts` null: the product into `out`; else the f32 partial of this block's k slice into
// `parts` (no bias: a split product feeds a norm that adds nothing of its own).
template <typename T, int MT>
__device__ void fp8_linear_mma(T *out, float *parts, const T *x, const uint8_t *w, const float *scale, const T *bias,
                               int rows, int n, int k, int block_rows, int block_cols) {
    __shared__ float part[MMA_WARPS * MT * MMA_TILES * 4 * 32];
    const Fp8MmaLane<T, MT> lane(x, w, scale, rows, n, k, block_rows, block_cols);
    const int warp = threadIdx.x / 32;
    const int2 range = chunk_range(k);
    float acc[MT][MMA_TILES][4] = {};

    for (int c0 = range.x + warp; c0 < range.y; c0 += MMA_WARPS * MMA_UNROLL) {
        uint4 wv[MMA_UNROLL][MMA_TILES];
#pragma unroll
        for (int u = 0; u < MMA_UNROLL; ++u) {
            const int kk = lane.chunk_k(c0 + u * MMA_WARPS);
            const bool mine = c0 + u * MMA_WARPS < range.y;
#pragma unroll
            for (int j = 0; j < MMA_TILES; ++j)
                wv[u][j] = mine && lane.loads(j, kk) ? load_streaming(lane.wrow[j] + kk) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < MMA_UNROLL; ++u) {
            if (c0 + u * MMA_WARPS >= range.y) break; // warp-uniform: mma.sync needs every lane
            lane.multiply(acc, wv[u], lane.chunk_k(c0 + u * MMA_WARPS));
        }
    }
    if (parts != nullptr)
        lane.finish_partial(acc, part, parts, rows);
    else
        lane.finish(acc, part, out, bias, rows);
}

// The same product with the weights streamed through shared memory, by persistent blocks: a
// block takes 16-column tiles blockIdx.x, + gridDim.x, ... (the launcher sizes the grid to the
// blocks the GPU holds at once), and each warp walks one sequence of (tile, chunk) steps, its
// chunks of a tile as the plain kernel shares k, keeping the next stages - 1 steps loading
// (cp.async, zero-filled past n or k) while it converts and multiplies one — across tile ends
// too, so the loads never drain. Where the plain kernel's block runs one round of loads and ends
// (k = 2048 is four chunks a warp), the GPU would otherwise wait on memory once a block. A lane
// reads back only the bytes it copied, so no barrier orders the ring; a slot is refilled after
// the chunk it held was multiplied. The warps' partial sums of a tile meet in shared memory
// after the rings (`finish`), two barriers a tile.
template <int MT> constexpr int pipe_part_bytes() { return MMA_WARPS * MT * MMA_TILES * 4 * 32 * (int)sizeof(float); }
template <int MT> constexpr int pipe_stages() { return (PIPE_SMEM_BYTES - pipe_part_bytes<MT>()) / (MMA_WARPS * PIPE_CHUNK_BYTES); }

template <typename T, int MT>
__device__ void fp8_linear_mma_pipe(T *out, const T *x, const uint8_t *w, const float *scale, const T *bias, int rows,
                                    int n, int k, int block_rows, int block_cols) {
    constexpr int STAGES = pipe_stages<MT>();
    static_assert(STAGES >= 2, "a ring of at least two stages beside the partial sums");
    extern __shared__ __align__(16) unsigned char pipe_smem[];
    Fp8MmaLane<T, MT> lane(x, w, scale, rows, n, k, block_rows, block_cols);
    const int warp = threadIdx.x / 32, l = threadIdx.x % 32;
    const int chunks = (k + 63) / 64, tiles = (n + MMA_COLS - 1) / MMA_COLS;
    // Chunks warp, warp + MMA_WARPS, ... of each tile are this warp's (as the plain kernel shares k).
    const int mine = warp < chunks ? (chunks - warp + MMA_WARPS - 1) / MMA_WARPS : 0;
    const int my_tiles = (int)blockIdx.x < tiles ? (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
    const int steps = my_tiles * mine;
    const unsigned ring = static_cast<unsigned>(__cvta_generic_to_shared(pipe_smem)) + warp * STAGES * PIPE_CHUNK_BYTES;
    const unsigned char *ring_ptr = pipe_smem + warp * STAGES * PIPE_CHUNK_BYTES;
    float *part = reinterpret_cast<float *>(pipe_smem + MMA_WARPS * STAGES * PIPE_CHUNK_BYTES);
    // Step p of this warp into its slot: each lane's 16 bytes of each n8 tile of the step's tile.
    auto issue = [&](int p) {
        const int tile = (int)blockIdx.x + (p / mine) * (int)gridDim.x;
        const int kk = lane.chunk_k(warp + (p % mine) * MMA_WARPS);
        const int slot = p % STAGES;
#pragma unroll
        for (int j = 0; j < MMA_TILES; ++j) {
            const int c = tile * MMA_COLS + 8 * j + lane.g;
            const bool ok = c < n && kk < k;
            cp_async16(ring + slot * PIPE_CHUNK_BYTES + (j * 32 + l) * 16, ok ? w + (long long)c * k + kk : w, ok);
        }
    };
    // One commit a step, empty past this warp's last, so that the wait below counts groups the
    // same way at every step.
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) {
        if (p < steps) issue(p);
        cp_async_commit();
    }
    int p = 0;
    for (int t = 0; t < my_tiles; ++t) {
        lane.at_columns(w, ((int)blockIdx.x + t * (int)gridDim.x) * MMA_COLS);
        float acc[MT][MMA_TILES][4] = {};
        for (int i = 0; i < mine; ++i, ++p) {
            cp_async_wait<STAGES - 2>(); // step p has landed
            uint4 wv[MMA_TILES];
#pragma unroll
            for (int j = 0; j < MMA_TILES; ++j)
                wv[j] = *reinterpret_cast<const uint4 *>(ring_ptr + (p % STAGES) * PIPE_CHUNK_BYTES + (j * 32 + l) * 16);
            // Refill the slot multiplied last step with step p + STAGES - 1 (perhaps a later tile's).
            if (p + STAGES - 1 < steps) issue(p + STAGES - 1);
            cp_async_commit();
            lane.multiply(acc, wv, lane.chunk_k(warp + i * MMA_WARPS));
        }
        lane.finish(acc, part, out, bias, rows);
        __syncthreads(); // every sum of this tile read before the next tile's are written
    }
    cp_async_wait<0>();
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

#define FP8_MMA_KERNEL(T, SUF, MT)                                                                              \
    extern "C" __global__ void fp8_linear_mma_m##MT##_##SUF(T *out, const T *x, const uint8_t *w,              \
                                                            const float *scale, const T *bias, int rows, int n, \
                                                            int k, int block_rows, int block_cols) {            \
        fp8_linear_mma<T, MT>(out, nullptr, x, w, scale, bias, rows, n, k, block_rows, block_cols);             \
    }                                                                                                           \
    extern "C" __global__ void fp8_linear_mma_parts_m##MT##_##SUF(float *parts, const T *x, const uint8_t *w,   \
                                                                  const float *scale, int rows, int n, int k,   \
                                                                  int block_rows, int block_cols) {             \
        fp8_linear_mma<T, MT>(nullptr, parts, x, w, scale, nullptr, rows, n, k, block_rows, block_cols);        \
    }                                                                                                           \
    extern "C" __global__ void fp8_linear_mma_pipe_m##MT##_##SUF(T *out, const T *x, const uint8_t *w,         \
                                                                 const float *scale, const T *bias, int rows,   \
                                                                 int n, int k, int block_rows, int block_cols) {\
        fp8_linear_mma_pipe<T, MT>(out, x, w, scale, bias, rows, n, k, block_rows, block_cols);                 \
    }

FP8_MMA_KERNEL(__nv_bfloat16, bf16, 1)
FP8_MMA_KERNEL(__nv_bfloat16, bf16, 2)
FP8_MMA_KERNEL(__nv_bfloat16, bf16, 4)
FP8_MMA_KERNEL(__half, f16, 1)
FP8_MMA_KERNEL(__half, f16, 2)
FP8_MMA_KERNEL(__half, f16, 4)

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
