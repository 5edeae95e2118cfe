// Probe (nvcc, on the device): a skinny-M bf16 GEMM for decode projections (y = x W^T, x [M, K]
// with M <= 64, W [N, K] row-major as checkpoints store it) that streams W once with 16-byte loads
// straight into registers and multiplies on tensor cores (mma.sync m16n8k16), timed on the 384
// projections of an Ouro-1.4B decode step (24 layers' weights cycled over 96 applications, gate/up
// fused with SiLU·mul) and per shape, plain and with programmatic dependent launch (PDL), and with
// candle's stream-ordered allocation before every kernel. Session 23 ran it against cuBLAS
// (tools/splitk_probe.py, same call): at 16 rows its best tiling took 3.94 ms for the step's
// projections against cuBLAS's 3.48 (o_proj and down split in 4); PDL gained <= 2 %, and none with
// an allocation node between kernels. Raw: docs/bench/raw-2026-12-02g/skinny_gemm_probe/.
//
//     nvcc -O3 -std=c++17 -arch=sm_90a tools/skinny_probe.cu -o /tmp/skinny && /tmp/skinny [rows...]
//
// k permutation: mma's B fragment wants, per lane (g = lane / 4, t = lane % 4), W[n0 + g] at
// logical k 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1). A 16-byte load of W[n0 + g][8t .. 8t+8) serves two
// mma steps if logical k (2t+j, 2t+8+j) is mapped to actual k (8t+j, 8t+2+j) in the first step and
// (8t+4+j, 8t+6+j) in the second; the A fragment (x rows g, g + 8) is loaded with the same map, so
// the dot product over k is unchanged.
#include "probe_ptx.cuh"
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include <algorithm>


__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;"); }

// MODE 0: y bf16 [M, N]; 1: f32 partials [gridDim.y, M, N]; 2: GLU, y bf16 [M, N/2] =
// silu(x W[0:N/2]^T) * (x W[N/2:N]^T): tiles 0 .. NT/2 are gate columns, the rest the same up
// columns. A warp covers 8 NT columns and every WK-th run of 32 U k of the block's k range; two
// register sets alternate so that one run's loads are in flight while the other's multiply.
template <int MT, int NT, int WK, int U, int MODE>
__global__ void __launch_bounds__(WK * 32) skinny(const __nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ w,
                                                  void *__restrict__ out, int M, int N, int K, int kchunk) {
    static_assert(MODE != 2 || NT % 2 == 0, "GLU pairs gate and up tiles");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int half = N / 2;
    const int n0 = MODE == 2 ? blockIdx.x * 4 * NT : blockIdx.x * 8 * NT;
    const int kb = blockIdx.y * kchunk, ke = min(K, kb + kchunk);
    pdl_launch();
    const __nv_bfloat16 *wrow[NT];
    bool wok[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        int row;
        if (MODE == 2) {
            constexpr int HALF_NT = NT / 2 > 0 ? NT / 2 : 1;
            const int c = n0 + 8 * (nt % HALF_NT) + g;
            wok[nt] = c < half;
            row = c + (nt >= NT / 2 ? half : 0);
        } else {
            row = n0 + 8 * nt + g;
            wok[nt] = row < N;
        }
        wrow[nt] = w + (size_t)(wok[nt] ? row : 0) * K;
    }
    const __nv_bfloat16 *xrow[MT][2];
    bool xok[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * mt + g + 8 * h;
            xok[mt][h] = row < M;
            xrow[mt][h] = x + (size_t)(xok[mt][h] ? row : 0) * K;
        }
    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;

    constexpr int RUN = 32 * U;  // k one register set covers
    const int stride = WK * RUN;
    uint4 wa[U][NT], wb[U][NT], xa[U][MT][2], xb[U][MT][2];
    const uint4 zero = make_uint4(0, 0, 0, 0);
    auto load_w = [&](uint4 (&dst)[U][NT], int kc) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = kc + 32 * u + 8 * t;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) dst[u][nt] = (wok[nt] && k < ke) ? ld_stream(wrow[nt] + k) : zero;
        }
    };
    auto load_x = [&](uint4 (&dst)[U][MT][2], int kc) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = kc + 32 * u + 8 * t;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    dst[u][mt][h] = (xok[mt][h] && k < ke) ? __ldg(reinterpret_cast<const uint4 *>(xrow[mt][h] + k)) : zero;
        }
    };
    auto mul = [&](const uint4 (&wv)[U][NT], const uint4 (&xv)[U][MT][2]) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const uint4 &a0 = xv[u][mt][0], &a1 = xv[u][mt][1], &b = wv[u][nt];
                    mma16816(acc[mt][nt], a0.x, a1.x, a0.y, a1.y, b.x, b.y);
                    mma16816(acc[mt][nt], a0.z, a1.z, a0.w, a1.w, b.z, b.w);
                }
    };
    int kc = kb + warp * RUN;
    load_w(wa, kc);  // weights do not depend on the previous kernel: stream them before waiting
    pdl_wait();
    load_x(xa, kc);
    for (; kc < ke; kc += 2 * stride) {
        load_w(wb, kc + stride);
        load_x(xb, kc + stride);
        mul(wa, xa);
        load_w(wa, kc + 2 * stride);
        load_x(xa, kc + 2 * stride);
        mul(wb, xb);
    }
    // Sum the warps' k runs through shared memory; c0,c1: row g, cols 2t,2t+1; c2,c3: row g + 8.
    __shared__ float red[WK][MT * 16][NT * 8 + 1];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            red[warp][16 * mt + g][8 * nt + 2 * t] = acc[mt][nt][0];
            red[warp][16 * mt + g][8 * nt + 2 * t + 1] = acc[mt][nt][1];
            red[warp][16 * mt + g + 8][8 * nt + 2 * t] = acc[mt][nt][2];
            red[warp][16 * mt + g + 8][8 * nt + 2 * t + 1] = acc[mt][nt][3];
        }
    __syncthreads();
    constexpr int COLS = MODE == 2 ? NT * 4 : NT * 8;
    for (int i = threadIdx.x; i < MT * 16 * COLS; i += WK * 32) {
        const int r = i / COLS, c = i % COLS;
        const int n = n0 + c;
        if (r >= M) continue;
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < WK; ++q) s += red[q][r][c];
        if (MODE == 2) {
            float u = 0.f;
#pragma unroll
            for (int q = 0; q < WK; ++q) u += red[q][r][COLS + c];
            if (n < half) reinterpret_cast<__nv_bfloat16 *>(out)[(size_t)r * half + n] = __float2bfloat16(s / (1.f + __expf(-s)) * u);
        } else if (n < N) {
            if (MODE == 1)
                reinterpret_cast<float *>(out)[((size_t)blockIdx.y * M + r) * N + n] = s;
            else
                reinterpret_cast<__nv_bfloat16 *>(out)[(size_t)r * N + n] = __float2bfloat16(s);
        }
    }
}

__global__ void ref_gemm(const __nv_bfloat16 *x, const __nv_bfloat16 *w, float *y, int M, int N, int K) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
    if (n >= N) return;
    float s = 0.f;
    for (int k = 0; k < K; ++k) s += __bfloat162float(x[(size_t)m * K + k]) * __bfloat162float(w[(size_t)n * K + k]);
    y[(size_t)m * N + n] = s;
}

struct Launch {
    bool pdl = false;
    bool alloc = false;  // cudaMallocAsync before the kernel, free of the previous one after (candle)
};

static void *g_prev = nullptr;

template <int MT, int NT, int WK, int U, int MODE>
void launch(cudaStream_t s, const Launch &l, const __nv_bfloat16 *x, const __nv_bfloat16 *w, void *out, int M, int N, int K, int splits) {
    void *tmp = nullptr;
    if (l.alloc) CK(cudaMallocAsync(&tmp, 1 << 16, s));
    const int cols = MODE == 2 ? 4 * NT : 8 * NT;
    const int nn = MODE == 2 ? N / 2 : N;
    const int kchunk = ((K + splits - 1) / splits + 31) / 32 * 32;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((nn + cols - 1) / cols, splits);
    cfg.blockDim = dim3(WK * 32);
    cfg.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = l.pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, skinny<MT, NT, WK, U, MODE>, x, w, out, M, N, K, kchunk));
    if (l.alloc) {
        if (g_prev) CK(cudaFreeAsync(g_prev, s));
        g_prev = tmp;
    }
}

struct Bufs {
    __nv_bfloat16 *xh, *xi, *y;  // activations: [64, 2048], [64, 5632], outputs [64, 11264]
    float *part;                 // [8, 64, 2048]
};

// One decode step's projections: 24 layers' weights cycled over 96 applications; gate/up as GLU.
template <int MT, int NT, int U>
void step(cudaStream_t s, const Launch &l, const Bufs &b, __nv_bfloat16 **wq, __nv_bfloat16 **wo, __nv_bfloat16 **wgu, __nv_bfloat16 **wd, int M, int so, int sd) {
    constexpr int H = 2048, I = 5632;
    constexpr int NG = NT < 2 ? 2 : NT;
    for (int app = 0; app < 96; ++app) {
        const int L = app % 24;
        launch<MT, NT, 4, U, 0>(s, l, b.xh, wq[L], b.y, M, 3 * H, H, 1);
        launch<MT, NT, 4, U, 1>(s, l, b.xh, wo[L], b.part, M, H, H, so);
        launch<MT, NG, 4, U, 2>(s, l, b.xh, wgu[L], b.y, M, 2 * I, H, 1);
        launch<MT, NT, 4, U, 1>(s, l, b.xi, wd[L], b.part, M, H, I, sd);
    }
}

template <typename F>
float graph_us(cudaStream_t s, F body) {
    cudaGraph_t gr;
    cudaGraphExec_t ex;
    g_prev = nullptr;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    body();
    if (g_prev) { CK(cudaFreeAsync(g_prev, s)); g_prev = nullptr; }
    CK(cudaStreamEndCapture(s, &gr));
    CK(cudaGraphInstantiate(&ex, gr, 0));
    const float us = median_graph_ms(ex, s, 15, 3) * 1000.f;
    CK(cudaGraphExecDestroy(ex));
    CK(cudaGraphDestroy(gr));
    return us;
}

template <int MT, int NT, int U, int MODE>
double check(cudaStream_t s, const __nv_bfloat16 *x, const __nv_bfloat16 *w, int M, int N, int K, int splits) {
    const int nn = MODE == 2 ? N / 2 : N;
    float *ref, *part;
    __nv_bfloat16 *y;
    CK(cudaMalloc(&ref, (size_t)M * N * 4));
    CK(cudaMalloc(&part, (size_t)splits * M * N * 4));
    CK(cudaMalloc(&y, (size_t)M * N * 2));
    ref_gemm<<<dim3((N + 127) / 128, M), 128, 0, s>>>(x, w, ref, M, N, K);
    launch<MT, NT, 4, U, MODE>(s, Launch{}, x, w, MODE == 1 ? (void *)part : (void *)y, M, N, K, splits);
    CK(cudaStreamSynchronize(s));
    std::vector<float> r((size_t)M * N), p((size_t)splits * M * N);
    std::vector<__nv_bfloat16> yy((size_t)M * N);
    CK(cudaMemcpy(r.data(), ref, r.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(p.data(), part, p.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(yy.data(), y, yy.size() * 2, cudaMemcpyDeviceToHost));
    double worst = 0, scale = 1e-6;
    for (float v : r) scale = std::max(scale, (double)fabsf(v));
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < nn; ++n) {
            double want, got;
            if (MODE == 2) {
                const double gg = r[(size_t)m * N + n], u = r[(size_t)m * N + nn + n];
                want = gg / (1 + exp(-gg)) * u;
                got = __bfloat162float(yy[(size_t)m * nn + n]);
            } else if (MODE == 1) {
                want = r[(size_t)m * N + n];
                got = 0;
                for (int q = 0; q < splits; ++q) got += p[((size_t)q * M + m) * N + n];
            } else {
                want = r[(size_t)m * N + n];
                got = __bfloat162float(yy[(size_t)m * N + n]);
            }
            worst = std::max(worst, fabs(want - got) / scale);
        }
    CK(cudaFree(ref));
    CK(cudaFree(part));
    CK(cudaFree(y));
    return worst;
}

static float g_copy_tbs = 0;

// One projection shape alone: a graph of 96 launches over 24 weights.
template <int MT, int NT, int U, int MODE>
void shape(cudaStream_t s, const char *name, const __nv_bfloat16 *x, __nv_bfloat16 **w, void *out, int M, int N, int K, int splits) {
    const float us = graph_us(s, [&] {
        for (int app = 0; app < 96; ++app) launch<MT, NT, 4, U, MODE>(s, Launch{}, x, w[app % 24], out, M, N, K, splits);
    }) / 96;
    const double mb = 2.0 * N * K / 1e6;
    printf("   %-8s split %d: %6.2f us  %5.2f TB/s (%3.0f %% of copy)\n", name, splits, us, mb / us, 100 * mb / us / g_copy_tbs);
}

template <int MT, int NT, int U>
void config(cudaStream_t s, int M, const Bufs &b, __nv_bfloat16 **wq, __nv_bfloat16 **wo, __nv_bfloat16 **wgu, __nv_bfloat16 **wd) {
    constexpr int NG = NT < 2 ? 2 : NT;
    printf("rows %d  NT %d  U %d: max error / max |y| (qkv, o split 4, GLU, down split 4): %.2e %.2e %.2e %.2e\n", M, NT, U,
           check<MT, NT, U, 0>(s, b.xh, wq[0], M, 6144, 2048, 1), check<MT, NT, U, 1>(s, b.xh, wo[0], M, 2048, 2048, 4),
           check<MT, NG, U, 2>(s, b.xh, wgu[0], M, 11264, 2048, 1), check<MT, NT, U, 1>(s, b.xi, wd[0], M, 2048, 5632, 4));
    shape<MT, NT, U, 0>(s, "qkv", b.xh, wq, b.y, M, 6144, 2048, 1);
    for (int sp : {1, 2, 4}) shape<MT, NT, U, 1>(s, "o", b.xh, wo, b.part, M, 2048, 2048, sp);
    shape<MT, NG, U, 2>(s, "gate_up", b.xh, wgu, b.y, M, 11264, 2048, 1);
    for (int sp : {1, 2, 4, 8}) shape<MT, NT, U, 1>(s, "down", b.xi, wd, b.part, M, 2048, 5632, sp);
    const double gb = 96.0 * 2 * (6144.0 * 2048 + 2048.0 * 2048 + 11264.0 * 2048 + 2048.0 * 5632) / 1e9;
    for (int sp : {2, 4})
        for (int pdl = 0; pdl < 2; ++pdl) {
            Launch l;
            l.pdl = pdl;
            const float us = graph_us(s, [&] { step<MT, NT, U>(s, l, b, wq, wo, wgu, wd, M, sp, sp); });
            printf("rows %d  NT %d  U %d  step, o/down split %d %-4s: %7.3f ms  %5.2f TB/s (%3.0f %% of copy)\n", M, NT, U, sp,
                   pdl ? "PDL" : "", us / 1000, gb / (us * 1e-6) / 1e3, 100 * gb / (us * 1e-6) / 1e3 / g_copy_tbs);
        }
}

template <int MT>
void run(cudaStream_t s, int M, const Bufs &b, __nv_bfloat16 **wq, __nv_bfloat16 **wo, __nv_bfloat16 **wgu, __nv_bfloat16 **wd) {
    if (MT < 4) config<MT, 1, 4>(s, M, b, wq, wo, wgu, wd);
    config<MT, 2, 2>(s, M, b, wq, wo, wgu, wd);
    if (MT < 4) config<MT, 2, 4>(s, M, b, wq, wo, wgu, wd);
    if (MT == 1) config<MT, 4, 2>(s, M, b, wq, wo, wgu, wd);
}

int main(int argc, char **argv) {
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    constexpr int H = 2048, I = 5632;
    __nv_bfloat16 *wq[24], *wo[24], *wgu[24], *wd[24];
    auto mk = [&](size_t n, uint32_t seed, float sc) {
        __nv_bfloat16 *p;
        CK(cudaMalloc(&p, n * 2));
        fill<<<1024, 256, 0, s>>>(p, n, seed, sc);
        return p;
    };
    for (int l = 0; l < 24; ++l) {
        wq[l] = mk((size_t)3 * H * H, 4 * l + 1, 0.05f);
        wo[l] = mk((size_t)H * H, 4 * l + 2, 0.05f);
        wgu[l] = mk((size_t)2 * I * H, 4 * l + 3, 0.05f);
        wd[l] = mk((size_t)H * I, 4 * l + 4, 0.05f);
    }
    Bufs b;
    b.xh = mk((size_t)64 * H, 7, 2.f);
    b.xi = mk((size_t)64 * I, 8, 2.f);
    CK(cudaMalloc(&b.y, (size_t)64 * 2 * I * 2));
    CK(cudaMalloc(&b.part, (size_t)8 * 64 * H * 4));
    CK(cudaStreamSynchronize(s));
    {
        void *a, *c;
        const size_t n = (size_t)2 << 30;
        CK(cudaMalloc(&a, n));
        CK(cudaMalloc(&c, n));
        const float us = graph_us(s, [&] { CK(cudaMemcpyAsync(c, a, n, cudaMemcpyDeviceToDevice, s)); });
        g_copy_tbs = 2.0 * n / (us * 1e-6) / 1e12;
        printf("copy bandwidth (read + write, 2 GiB): %.2f TB/s\n", g_copy_tbs);
        CK(cudaFree(a));
        CK(cudaFree(c));
    }
    std::vector<int> rows;
    for (int i = 1; i < argc; ++i) rows.push_back(atoi(argv[i]));
    if (rows.empty()) rows = {16};
    for (int M : rows) {
        if (M <= 16) run<1>(s, M, b, wq, wo, wgu, wd);
        else if (M <= 32) run<2>(s, M, b, wq, wo, wgu, wd);
        else run<4>(s, M, b, wq, wo, wgu, wd);
    }
    return 0;
}
