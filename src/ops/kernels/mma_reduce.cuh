// The end of the decode-width tensor-core linear kernels (fp8.cu): a block's
// warps each hold m16n8 fragments of the same 16·MT × 8·TILES output tile over their own share
// of k; these are summed across the warps through shared memory and handed out one output value
// a call.
#pragma once

namespace {

// Sums every warp's fragments `acc` (fragment value i of tile (m, j) at row 16m + g + 8(i / 2),
// column 8j + 2t + i % 2 of lane 4g + t) through `part` (WARPS · MT·TILES·4 · 32 floats of shared
// memory, free to overwrite), a value a thread, and calls emit(row, col, sum) for each output
// inside `rows` × `n` (columns from col0), in warp order. Every thread of the block must call it.
template <int WARPS, int MT, int TILES, class Emit>
__device__ __forceinline__ void reduce_fragments(const float (&acc)[MT][TILES][4], float *part, int col0, int rows, int n,
                                                 Emit emit) {
    constexpr int VALUES = MT * TILES * 4;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int j = 0; j < TILES; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[(warp * VALUES + (m * TILES + j) * 4 + i) * 32 + lane] = acc[m][j][i];
    __syncthreads();
    for (int e = threadIdx.x; e < VALUES * 32; e += blockDim.x) {
        const int ji = e / 32, l = e % 32;
        const int m = ji / (TILES * 4), j = ji / 4 % TILES, i = ji % 4;
        const int row = 16 * m + l / 4 + 8 * (i / 2), col = col0 + 8 * j + 2 * (l % 4) + (i % 2);
        if (row >= rows || col >= n) continue;
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < WARPS; ++q) v += part[(q * VALUES + ji) * 32 + l];
        emit(row, col, v);
    }
}

} // namespace
