// What tools/persistent_probe.cu and tools/ring_probe.cu share: the projection chain of an
// Ouro-1.4B decode step at 16 (or 64) rows (QKV -> o_proj -> gate/up -> SiLU·mul -> down, 24 layers'
// weights), its work units (16 output columns x 256 of k), x staged in shared memory as bf16, the
// split-k reduction, and a reference for the first 8 phases.
#pragma once
#include "probe_ptx.cuh"
#include <math.h>
#include <vector>
#include <algorithm>
#include <string>

// Rows of the chain: 16 unless built with -DPROBE_ROWS=64 (tools/ring_probe.cu only; the other
// probes' kernels hold one m16 tile).
#ifndef PROBE_ROWS
#define PROBE_ROWS 16
#endif
constexpr int H = 2048, I = 5632, L = 24, ROWS = PROBE_ROWS;
static_assert(ROWS == 16 || ROWS == 64, "the probes run 16 or 64 rows");
constexpr int KP = 256;           // k of one unit
constexpr int TC = 16;            // output columns of one unit
// k-pieces a block's range may touch (checked on the host): at 64 rows two, so that the staged x
// and 16 ring stages fit a block's shared memory (one block an SM of 132 touches at most two).
constexpr int MAX_PIECES = ROWS == 16 ? 4 : 2;
constexpr int BUF = ROWS * 2 * I; // floats of one activation buffer (the widest output)

struct PhaseShape {
    int n, k, x_stride, x_glu;  // output columns, k, row stride of x, x = silu(x[:, k]) * x[:, I + k]
};

__host__ __device__ inline PhaseShape shape_of(int kind) {
    switch (kind) {
    case 0: return {3 * H, H, H, 0};          // QKV reads the layer input [ROWS, 2048]
    case 1: return {H, H, 3 * H, 0};          // o_proj reads QKV's first 2048 columns
    case 2: return {2 * I, H, H, 0};          // gate/up reads o_proj's output
    default: return {H, I, 2 * I, 1};         // down reads silu(gate) * up
    }
}

// Fire-and-forget f32 pair add at L2 (no value returned, so the warp does not wait on it).
__device__ __forceinline__ void red_add2(float *p, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned *p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}

// A phase's unit range for one block: contiguous, sizes differing by at most one.
__host__ __device__ inline void block_range(int units, int blocks, int b, int &u0, int &u1) {
    u0 = (int)((long long)units * b / blocks);
    u1 = (int)((long long)units * (b + 1) / blocks);
}

// Stage `quads` float4s of x (the block's k-pieces from piece0) in shared memory as bf16, applying
// SiLU·mul for down: NT threads take part, SB float4 loads in flight a thread before any is used
// (a latency a barrier before it cannot hide). The caller synchronises after.
template <int NT, int SB>
__device__ __forceinline__ void stage_x(__nv_bfloat16 (*xs)[ROWS][KP + 32], const float *x, const PhaseShape &s, int piece0, int quads) {
    for (int base = threadIdx.x; base < quads; base += SB * NT) {
        float4 a[SB], b[SB];
#pragma unroll
        for (int j = 0; j < SB; ++j) {
            const int i = base + j * NT;
            if (i < quads) {
                const int pc = i / (ROWS * KP / 4), rem = i - pc * (ROWS * KP / 4), r = rem / (KP / 4), c = 4 * (rem - r * (KP / 4));
                const float *src = x + (size_t)r * s.x_stride + (piece0 + pc) * KP + c;
                a[j] = __ldcg(reinterpret_cast<const float4 *>(src));
                if (s.x_glu) b[j] = __ldcg(reinterpret_cast<const float4 *>(src + I));
            }
        }
#pragma unroll
        for (int j = 0; j < SB; ++j) {
            const int i = base + j * NT;
            if (i < quads) {
                const int pc = i / (ROWS * KP / 4), rem = i - pc * (ROWS * KP / 4), r = rem / (KP / 4), c = 4 * (rem - r * (KP / 4));
                float v[4] = {a[j].x, a[j].y, a[j].z, a[j].w};
                if (s.x_glu) {
                    const float u4[4] = {b[j].x, b[j].y, b[j].z, b[j].w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) v[e] = v[e] / (1.f + __expf(-v[e])) * u4[e];
                }
                *reinterpret_cast<uint2 *>(&xs[pc][r][c]) = make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
            }
        }
    }
}

// Reference of one phase: out[r][n] = sum_k bf16(x'[r][k]) * W[n][k], x' as the probes stage it.
__global__ void ref_phase(const __nv_bfloat16 *w, const float *x, float *out, int kind) {
    const PhaseShape s = shape_of(kind);
    const int n = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (n >= s.n) return;
    float acc = 0.f;
    for (int k = 0; k < s.k; ++k) {
        float v;
        if (s.x_glu) {
            const float gt = x[(size_t)r * s.x_stride + k], up = x[(size_t)r * s.x_stride + I + k];
            v = gt / (1.f + __expf(-gt)) * up;
        } else {
            v = x[(size_t)r * s.x_stride + k];
        }
        acc += __bfloat162float(__float2bfloat16(v)) * __bfloat162float(w[(size_t)n * s.k + k]);
    }
    out[(size_t)r * s.n + n] = acc;
}

// Relative error (root of summed squared differences over summed squares) of `n` floats at
// `got` against `want`, both on the device; prints it under `label` with the reference's rms.
inline double report_rel_err(const float *got_dev, const float *want_dev, size_t n, const char *label) {
    std::vector<float> got(n), want(n);
    CK(cudaMemcpy(got.data(), got_dev, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(want.data(), want_dev, n * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t i = 0; i < n; ++i) {
        num += (got[i] - want[i]) * (double)(got[i] - want[i]);
        den += (double)want[i] * want[i];
    }
    const double err = sqrt(num / std::max(den, 1e-30));
    printf("%s: rel err %.2e (|ref| rms %.3f)\n", label, err, sqrt(den / n));
    return err;
}

// The reference chain of phases [0, phases) from x0 into ref[kind] (ref: four [BUF] buffers);
// `input(p, x)` gives the input phase p reads, x being the previous phase's output (a norm step may
// stand between: tools/probe_norms.cuh). Returns the last phase's output once the stream is done.
template <typename WeightOf, typename Input>
const float *reference_phases(cudaStream_t st, WeightOf weight, const float *x0, int phases, float *const ref[4], Input input) {
    const float *x = x0;
    for (int p = 0; p < phases; ++p) {
        const int kind = p % 4;
        const PhaseShape s = shape_of(kind);
        ref_phase<<<dim3((s.n + 127) / 128, ROWS), 128, 0, st>>>(weight(kind, (p / 4) % L), input(p, x), ref[kind], kind);
        x = ref[kind];
    }
    CK(cudaStreamSynchronize(st));
    return x;
}

// Relative error of `got` (device, [ROWS, H]: what phase 7, down of application 1, wrote) against
// the reference chain of the first 8 phases from x0; weight(kind, layer) gives the plain weights,
// ref holds four [BUF] scratch buffers. Prints the error under `label`.
template <typename WeightOf>
double check_first_8_phases(cudaStream_t st, WeightOf weight, const float *x0, float *const ref[4], const float *got_dev, const char *label) {
    reference_phases(st, weight, x0, 8, ref, [](int, const float *x) { return x; });
    const std::string what = std::string(label) + ", after 8 phases";
    return report_rel_err(got_dev, ref[3], (size_t)ROWS * H, what.c_str());
}

// GB of weights the 384 projections of a step read (96 layer applications).
constexpr double STEP_WEIGHT_GB = 96.0 * 2 * (6144.0 * 2048 + 2048.0 * 2048 + 11264.0 * 2048 + 2048.0 * 5632) / 1e9;
