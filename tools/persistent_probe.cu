// Probe (nvcc, on the device): do the 384 projections of an Ouro-1.4B decode step at 16 rows run
// faster as phases of ONE persistent kernel than as 384 launches? Session 23 found cuBLAS's decode
// projections at ≈ 3.1 µs + bytes ÷ 4.37 TB/s a call: the step loses ≈ 1.2 ms to a fixed cost per
// launch that a better streaming loop did not remove (tools/skinny_probe.cu). Here one block per
// SM runs every phase (QKV, o_proj, gate/up, down; × 96 layer applications, 24 layers' weights
// cycled), phases separated by a grid barrier (a global arrival counter), and each warp loads its
// first weight unit of the next phase *before* waiting at the barrier, so weight streaming does
// not stop between phases. The same kernel run one phase a launch (a CUDA graph of 384 launches)
// isolates what the barrier buys over launches, and the persistent launch with no units (barriers
// and buffer zeroing alone) what the 383 barriers cost; tools/splitk_probe.py gives cuBLAS in the
// same call.
//
//     nvcc -O3 -std=c++17 -arch=sm_90a tools/persistent_probe.cu -o /tmp/persistent && /tmp/persistent
//
// Dataflow (a chain with the step's dependencies, norms / RoPE / attention left out): x (f32
// [16, 2048]) -> QKV [16, 6144]; its first 2048 columns -> o_proj [16, 2048] -> gate/up
// [16, 11264] -> down on silu(gate) * up [16, 5632] -> [16, 2048] = the next layer's x.
// Work unit: 16 output columns (two mma n8 tiles) x 256 of k; a phase's units are ordered
// k-piece-major and cut into one contiguous range per block, so a block needs x for one to three
// k-pieces, which it stages in shared memory as bf16 (applying SiLU·mul for down) after the
// barrier. Partial sums over k-pieces meet by f32 atomicAdd (float2, reduced at L2) in the
// phase's output buffer — 128 a unit, ≈ 1.6 M a layer application, a cost this probe also shows; three
// buffers rotate (phase p writes buf[p % 3], reads buf[(p + 2) % 3], zeroes buf[(p + 1) % 3]).
// k permutation as in skinny_probe.cu: one 16-byte load of W feeds two mma.m16n8k16 steps.
#include "probe_chain.cuh"
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include <algorithm>


static_assert(ROWS == 16, "this probe's kernel holds one m16 tile of rows");
constexpr int WARPS = 8, THREADS = WARPS * 32;

struct Weights {
    const __nv_bfloat16 *qkv[L], *o[L], *gu[L], *down[L];
};

// The 16 W rows of a unit (tile columns) for lane (g, t): rows tile * 16 + g and + 8, k from
// piece * KP + 8 t in 8 runs of 32.
__device__ __forceinline__ void load_unit(uint4 (&w)[2][8], const __nv_bfloat16 *wt, const PhaseShape &s, int unit, int g, int t) {
    const int ntile = s.n / TC;
    const int piece = unit / ntile, tile = unit - piece * ntile;
    const int kbase = piece * KP + 8 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const __nv_bfloat16 *row = wt + (size_t)(tile * TC + 8 * h + g) * s.k + kbase;
#pragma unroll
        for (int r = 0; r < 8; ++r) w[h][r] = ld_stream(row + 32 * r);
    }
}

__host__ __device__ inline const __nv_bfloat16 *weight_of(const Weights &wts, int kind, int layer) {
    return kind == 0 ? wts.qkv[layer] : kind == 1 ? wts.o[layer] : kind == 2 ? wts.gu[layer] : wts.down[layer];
}

// Phases [p0, p1) of the step (phase p: application p / 4, kind p % 4). grid_barrier: the
// phases run in one launch, separated by the arrival counter `arrive` (zero at launch).
__global__ void __launch_bounds__(THREADS, 1) persistent(Weights wts, float *bufs, const float *x0, int p0, int p1, unsigned *arrive, int grid_barrier, int work) {
    __shared__ __align__(16) __nv_bfloat16 xs[MAX_PIECES][ROWS][KP + 32];  // rows 64 bytes apart mod 128: no bank conflicts
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    // This block's units of a phase (none with work == 0: barriers and staging alone are timed).
    auto range = [&](const PhaseShape &sh, int &a, int &b) {
        block_range(sh.n / TC * (sh.k / KP), gridDim.x, blockIdx.x, a, b);
        if (!work) b = a;
    };
    uint4 w[2][8];
    // The first unit of the first phase.
    {
        const int kind = p0 % 4;
        const PhaseShape s = shape_of(kind);
        int u0, u1;
        range(s, u0, u1);
        if (u0 + warp < u1) load_unit(w, weight_of(wts, kind, (p0 / 4) % L), s, u0 + warp, g, t);
    }
    for (int p = p0; p < p1; ++p) {
        const int kind = p % 4;
        const PhaseShape s = shape_of(kind);
        const int ntile = s.n / TC;
        int u0, u1;
        range(s, u0, u1);
        float *out = bufs + (size_t)(p % 3) * BUF;
        const float *x = p == 0 ? x0 : bufs + (size_t)((p + 2) % 3) * BUF;
        // Zero the buffer phase p + 1 writes (last read by phase p - 1, which is complete).
        float *next = bufs + (size_t)((p + 1) % 3) * BUF;
        const int next_quads = ROWS * shape_of((p + 1) % 4).n / 4;
        for (int i = blockIdx.x * THREADS + threadIdx.x; i < next_quads; i += gridDim.x * THREADS)
            reinterpret_cast<float4 *>(next)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        // Stage x of this block's k-pieces in shared memory as bf16: float4 loads, eight in flight
        // a thread before any is used (this is a latency the barrier cannot hide).
        const int piece0 = u0 / ntile, pieces = u1 > u0 ? (u1 - 1) / ntile - piece0 + 1 : 0;
        const int quads = pieces * ROWS * KP / 4;
        stage_x<THREADS, 8>(xs, x, s, piece0, quads);
        __syncthreads();
        const __nv_bfloat16 *wt = weight_of(wts, kind, (p / 4) % L);
        for (int u = u0 + warp; u < u1; u += WARPS) {
            const int piece = u / ntile, tile = u - piece * ntile;
            uint4 cur[2][8];
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int r = 0; r < 8; ++r) cur[h][r] = w[h][r];
            // The next unit of this warp: this phase's, or the next phase's first (streamed before
            // the barrier, since weights do not depend on it).
            if (u + WARPS < u1) {
                load_unit(w, wt, s, u + WARPS, g, t);
            } else if (p + 1 < p1) {
                const int nk = (p + 1) % 4;
                const PhaseShape ns = shape_of(nk);
                int n0, n1;
                range(ns, n0, n1);
                if (n0 + warp < n1) load_unit(w, weight_of(wts, nk, ((p + 1) / 4) % L), ns, n0 + warp, g, t);
            }
            float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
            const int pc = piece - piece0;
#pragma unroll
            for (int r = 0; r < 8; ++r) {
                const uint4 a0 = *reinterpret_cast<const uint4 *>(&xs[pc][g][32 * r + 8 * t]);
                const uint4 a1 = *reinterpret_cast<const uint4 *>(&xs[pc][g + 8][32 * r + 8 * t]);
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    mma16816(acc[h], a0.x, a1.x, a0.y, a1.y, cur[h][r].x, cur[h][r].y);
                    mma16816(acc[h], a0.z, a1.z, a0.w, a1.w, cur[h][r].z, cur[h][r].w);
                }
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = tile * TC + 8 * h + 2 * t;
                // Vector reductions at L2 (sm_90): two per lane and n8 tile.
                red_add2(out + (size_t)g * s.n + col, acc[h][0], acc[h][1]);
                red_add2(out + (size_t)(g + 8) * s.n + col, acc[h][2], acc[h][3]);
            }
        }
        if (u0 + warp >= u1 && p + 1 < p1) {  // no unit here: the next phase's first still streams now
            const int nk = (p + 1) % 4;
            const PhaseShape ns = shape_of(nk);
            int n0, n1;
            range(ns, n0, n1);
            if (n0 + warp < n1) load_unit(w, weight_of(wts, nk, ((p + 1) / 4) % L), ns, n0 + warp, g, t);
        }
        if (grid_barrier && p + 1 < p1) {
            __syncthreads();
            if (threadIdx.x == 0) {
                __threadfence();
                atomicAdd(arrive, 1u);
                const unsigned target = (unsigned)(p - p0 + 1) * gridDim.x;
                while (ld_acquire(arrive) < target) {
                }
            }
        }
        __syncthreads();
    }
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int per_sm;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent, THREADS, 0));
    printf("SMs %d, persistent blocks an SM %d\n", sms, per_sm);
    if (per_sm < 1) return 1;
    const int blocks = sms;
    for (int kind = 0; kind < 4; ++kind) {  // a block's range must touch at most MAX_PIECES pieces
        const PhaseShape s = shape_of(kind);
        const int ntile = s.n / TC;
        for (int b = 0; b < blocks; ++b) {
            int u0, u1;
            block_range(ntile * (s.k / KP), blocks, b, u0, u1);
            if (u1 > u0 && (u1 - 1) / ntile - u0 / ntile + 1 > MAX_PIECES) { printf("phase %d: too many pieces\n", kind); return 1; }
        }
    }
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    Weights wts;
    auto mk = [&](size_t n, uint32_t seed, int k) {
        __nv_bfloat16 *p;
        CK(cudaMalloc(&p, n * 2));
        fill<<<1024, 256, 0, st>>>(p, n, seed, 3.46f / sqrtf((float)k));  // keeps activations O(1)
        return p;
    };
    for (int l = 0; l < L; ++l) {
        wts.qkv[l] = mk((size_t)3 * H * H, 4 * l + 1, H);
        wts.o[l] = mk((size_t)H * H, 4 * l + 2, H);
        wts.gu[l] = mk((size_t)2 * I * H, 4 * l + 3, H);
        wts.down[l] = mk((size_t)H * I, 4 * l + 4, I);
    }
    float *bufs, *x0, *ref[4];
    unsigned *arrive;
    CK(cudaMalloc(&bufs, (size_t)3 * BUF * 4));
    CK(cudaMalloc(&x0, (size_t)ROWS * H * 4));
    for (auto &r : ref) CK(cudaMalloc(&r, (size_t)BUF * 4));
    CK(cudaMalloc(&arrive, 4));
    {
        std::vector<float> h((size_t)ROWS * H);
        for (size_t i = 0; i < h.size(); ++i) h[i] = sinf(0.37f * i) * 1.5f;
        CK(cudaMemcpyAsync(x0, h.data(), h.size() * 4, cudaMemcpyHostToDevice, st));
        CK(cudaStreamSynchronize(st));
    }
    auto run = [&](int p0, int p1, bool barrier, int work = 1) {
        if (barrier) CK(cudaMemsetAsync(arrive, 0, 4, st));
        if (p0 == 0) CK(cudaMemsetAsync(bufs, 0, (size_t)BUF * 4, st));  // phase 0's output
        int gb = barrier;
        void *args[] = {&wts, &bufs, &x0, &p0, &p1, &arrive, &gb, &work};
        if (barrier)
            CK(cudaLaunchCooperativeKernel((void *)persistent, blocks, THREADS, args, 0, st));
        else
            persistent<<<blocks, THREADS, 0, st>>>(wts, bufs, x0, p0, p1, arrive, 0, work);
    };
    const int PHASES = 96 * 4;
    // Check: the first 8 phases (two layer applications), in one launch and one phase a launch,
    // against the reference chain.
    for (int mode = 0; mode < 2; ++mode) {
        if (mode == 0) run(0, 8, true);
        else for (int p = 0; p < 8; ++p) run(p, p + 1, false);
        CK(cudaStreamSynchronize(st));
        // Phase 7 (down of application 1) wrote bufs[7 % 3].
        check_first_8_phases(st, [&](int kind, int l) { return weight_of(wts, kind, l); }, x0, ref, bufs + (size_t)(7 % 3) * BUF, mode == 0 ? "one launch" : "a launch a phase");
    }
    const double gb = STEP_WEIGHT_GB;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    // One launch a phase, as a graph (384 kernels + their memsets).
    cudaGraph_t gr;
    cudaGraphExec_t ex;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    for (int p = 0; p < PHASES; ++p) run(p, p + 1, false);
    CK(cudaStreamEndCapture(st, &gr));
    CK(cudaGraphInstantiate(&ex, gr, 0));
    for (int rep = 0; rep < 2; ++rep) {
        for (int mode = 0; mode < 3; ++mode) {
            std::vector<float> ts;
            for (int i = 0; i < 12; ++i) {
                CK(cudaEventRecord(e0, st));
                if (mode == 0) run(0, PHASES, true);
                else if (mode == 1) CK(cudaGraphLaunch(ex, st));
                else run(0, PHASES, true, 0);
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (i >= 2) ts.push_back(ms);
            }
            std::sort(ts.begin(), ts.end());
            const float ms = ts[ts.size() / 2];
            printf("384 projections at 16 rows, %-28s: %6.3f ms  %5.2f TB/s\n", mode == 0 ? "one persistent launch" : mode == 1 ? "a launch a phase (graph)" : "barriers and zeroing alone", ms, gb / (ms * 1e-3) / 1e3);
        }
    }
    return 0;
}
