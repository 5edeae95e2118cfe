// The row norms of an Ouro layer folded into the projections that read them (tools/ring_probe.cu's
// fused cases, session 32). In the library a decode layer application runs two norm launches and a
// SiLU·mul launch beside its four projections (≈ 10 µs of a 60-µs application at 16 rows on the
// H200, session 31); here gate/up stages its input through the sandwich norm after o_proj and QKV
// through the one after down, inside the projection kernel.
//
// With x the projection just summed (o_proj's or down's output, f32) and h the residual:
//     h' = h + rx · x ⊙ w_x,   rx = rsqrt(mean(x²) + eps)
//     staged = rh · h' ⊙ w_n,  rh = rsqrt(mean(h'²) + eps)
// and mean(h'²) = (Σh² + 2 rx Σ h x w_x + rx² Σ (x w_x)²) / H, so a row's two scales follow from
// four sums over the row — x², h·x·w_x, (x·w_x)², h² — that split over k pieces. Each piece's owner
// (the block whose unit range holds the piece's first unit) sums its staged piece and publishes;
// every block waits for all the pieces' sums through a counter (the owners are blocks of the same
// launch, all resident: a dependency on PIECES_H blocks, not a grid barrier), then scales what it
// staged. Owners write h' for their pieces (a ping-pong residual: no block reads what another
// writes in the same phase). Sums per (piece, row) are deterministic: two warps add into shared
// memory from zero, and the pieces are summed in order.
#pragma once
#include "probe_chain.cuh"

constexpr int PIECES_H = H / KP;  // k pieces of a projection that reads the hidden state (8)
constexpr float EPS = 1e-6f;
constexpr int PHASES = 96 * 4;    // a decode step: 96 layer applications of 4 projections

struct Norms {
    // Per layer: 0 input_layernorm_2 (on o_proj's output), 1 post_attention_layernorm (on the
    // residual after it, read by gate/up), 2 post_attention_layernorm_2 (on down's output),
    // 3 input_layernorm (on the residual after it, read by the layer's QKV).
    const __nv_bfloat16 *w[L][4];
    float *res[2];    // the residual, f32 [ROWS, H]: gate/up phases read 0 and write 1, QKV phases the reverse
    float *sums;      // [PHASES][PIECES_H][ROWS][4]
    unsigned *ready;  // [PHASES]: pieces whose sums are published (zeroed before a step)
    int on;
};

// Phases that stage a normed input: gate/up, and QKV past the first (which reads x0 as it is).
__host__ __device__ inline bool norm_phase(const Norms &nm, int p) { return nm.on && (p % 4 == 2 || (p % 4 == 0 && p > 0)); }

// The two norm weights of norm phase p: gate/up's on o_proj's output and on the residual after it;
// QKV's on the previous layer's down output and on the residual after it (this layer's input norm).
struct NormWeights {
    const __nv_bfloat16 *x, *n;
};
__host__ __device__ inline NormWeights norm_weights(const Norms &nm, int p) {
    const int l = (p / 4) % L;
    if (p % 4 == 2) return {nm.w[l][0], nm.w[l][1]};
    return {nm.w[((p - 1) / 4) % L][2], nm.w[l][3]};
}

__device__ __forceinline__ void unpack4_bf16(uint2 raw, float (&f)[4]) {
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&raw.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&raw.y));
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}

__device__ __forceinline__ float warp_sum32(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Stage the normed input of norm phase `p` (see the top of this file) for the block's `pieces`
// k pieces from `piece0` (at most two) into xs as bf16; x = the previous phase's output [ROWS, H].
// NT consumer threads take part, `sync` synchronises exactly them; the caller synchronises after.
// At 16 rows a thread's x and h (8 float4s each) are loaded once and held across the wait; at 64
// rows (32 each) they are read in batches of 8, by the owners for the sums and by every block again
// after the wait.
template <int NT, class Sync>
__device__ void stage_normed(__nv_bfloat16 (*xs)[ROWS][KP + 32], const float *x, const Norms &nm, int p, int piece0, int pieces, int u0, int u1, int ntile, Sync sync) {
    constexpr int QPP = ROWS * KP / 4;  // float4s of one piece
    constexpr int PER = 2 * QPP / NT;   // a thread's float4s at two pieces
    constexpr int BATCH = 8;            // float4s of x and of h a thread holds at once
    constexpr bool HELD = PER <= BATCH;
    constexpr int NB = HELD ? PER : BATCH;
    static_assert(QPP % NT == 0 && NT % 64 == 0 && PER % NB == 0, "a warp's float4s of one load lie in one row");
    __shared__ float part[2][ROWS][4];
    __shared__ float scale[ROWS][2];
    const int kind = p % 4;
    const NormWeights w = norm_weights(nm, p);
    const __nv_bfloat16 *wx = w.x, *wn = w.n;
    const float *hin = nm.res[kind == 2 ? 0 : 1];
    float *hout = nm.res[kind == 2 ? 1 : 0];
    const int quads = pieces * QPP;
    auto owned = [&](int pc) {
        const int first = (piece0 + pc) * ntile;
        return first >= u0 && first < u1;
    };
    // Float4 i of the block's pieces: piece pc, row r, column c within the piece.
    auto coords = [](int i, int &pc, int &r, int &c) {
        pc = i / QPP;
        const int rem = i - pc * QPP;
        r = rem / (KP / 4);
        c = 4 * (rem - r * (KP / 4));
    };
    // x and h of float4s j0 .. j0 + NB of this thread (of owned pieces only, with `owners_only`).
    float4 xv[NB], hv[NB];
    auto load = [&](int j0, bool owners_only) {
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            const int i = threadIdx.x + (j0 + j) * NT;
            int pc, r, c;
            coords(i, pc, r, c);
            if (i < quads && (!owners_only || owned(pc))) {
                const size_t off = (size_t)r * H + (piece0 + pc) * KP + c;
                xv[j] = __ldcg(reinterpret_cast<const float4 *>(x + off));
                hv[j] = __ldcg(reinterpret_cast<const float4 *>(hin + off));
            }
        }
    };
    for (int i = threadIdx.x; i < 2 * ROWS * 4; i += NT) (&part[0][0][0])[i] = 0.f;
    if constexpr (HELD) load(0, false);  // all of it, before the wait (the norm weights are loaded where used: held too, they would spill)
    sync();  // part zeroed
    for (int j0 = 0; j0 < PER; j0 += NB) {
        if constexpr (!HELD) load(j0, true);
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            const int i = threadIdx.x + (j0 + j) * NT;
            if (i >= quads) continue;  // warp-uniform: quads is a multiple of NT
            int pc, r, c;
            coords(i, pc, r, c);
            if (!owned(pc)) continue;  // warp-uniform: one piece a warp a load
            float w4[4];
            unpack4_bf16(*reinterpret_cast<const uint2 *>(wx + (piece0 + pc) * KP + c), w4);
            const float xe[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w}, he[4] = {hv[j].x, hv[j].y, hv[j].z, hv[j].w};
            float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float xw = xe[e] * w4[e];
                s[0] += xe[e] * xe[e];
                s[1] += he[e] * xw;
                s[2] += xw * xw;
                s[3] += he[e] * he[e];
            }
#pragma unroll
            for (int k = 0; k < 4; ++k) s[k] = warp_sum32(s[k]);
            // Two warps cover a (piece, row) a load: two adds from zero commute exactly. (At 64
            // rows a (piece, row) also takes one load only, 64 float4s: the same two warps.)
            if ((threadIdx.x & 31) == 0)
#pragma unroll
                for (int k = 0; k < 4; ++k) atomicAdd(&part[pc][r][k], s[k]);
        }
    }
    sync();
    int mine = 0;
    for (int pc = 0; pc < pieces; ++pc) {
        if (!owned(pc)) continue;
        ++mine;
        for (int i = threadIdx.x; i < ROWS * 4; i += NT) nm.sums[((size_t)p * PIECES_H + piece0 + pc) * ROWS * 4 + i] = (&part[pc][0][0])[i];
    }
    if (mine) {  // block-uniform
        // The other threads' stores reach thread 0 through the barrier; its fence then precedes
        // the count in program order (a release pattern in PTX's model, as in the grid barrier of
        // ring_probe.cu). A fence in each thread before the barrier is no release of the count.
        sync();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(&nm.ready[p], (unsigned)mine);
        }
    }
    if (threadIdx.x < ROWS) {
        // Each reading thread acquires the counter itself, so the sums it then loads are published.
        while (ld_acquire(&nm.ready[p]) < (unsigned)PIECES_H) {
        }
        float S[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll  // every piece's sums in flight at once: one L2 round trip, not eight
        for (int q = 0; q < PIECES_H; ++q)
#pragma unroll
            for (int k = 0; k < 4; ++k) S[k] += __ldcg(&nm.sums[((size_t)p * PIECES_H + q) * ROWS * 4 + threadIdx.x * 4 + k]);
        const float rx = rsqrtf(S[0] / H + EPS);
        const float hh = S[3] + 2.f * rx * S[1] + rx * rx * S[2];
        scale[threadIdx.x][0] = rx;
        scale[threadIdx.x][1] = rsqrtf(fmaxf(hh, 0.f) / H + EPS);
    }
    __syncwarp();  // warp 0 reconverges after its lanes' spin before the (aligned) barrier
    sync();
    for (int j0 = 0; j0 < PER; j0 += NB) {
        if constexpr (!HELD) load(j0, false);
#pragma unroll
        for (int j = 0; j < NB; ++j) {
            const int i = threadIdx.x + (j0 + j) * NT;
            if (i >= quads) continue;
            int pc, r, c;
            coords(i, pc, r, c);
            const int col = (piece0 + pc) * KP + c;
            float wx4[4], wn4[4];
            unpack4_bf16(*reinterpret_cast<const uint2 *>(wx + col), wx4);
            unpack4_bf16(*reinterpret_cast<const uint2 *>(wn + col), wn4);
            const float rx = scale[r][0], rh = scale[r][1];
            const float xe[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w}, he[4] = {hv[j].x, hv[j].y, hv[j].z, hv[j].w};
            float hn[4], v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                hn[e] = he[e] + rx * xe[e] * wx4[e];
                v[e] = rh * hn[e] * wn4[e];
            }
            if (owned(pc)) *reinterpret_cast<float4 *>(hout + (size_t)r * H + col) = make_float4(hn[0], hn[1], hn[2], hn[3]);
            *reinterpret_cast<uint2 *>(&xs[pc][r][c]) = make_uint2(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]));
        }
    }
}

// Reference of a norm step, one thread a row in f64 sums: h_out = h + rx x w_x, n_out = rh h_out w_n.
__global__ void ref_norm(const float *x, const float *h, const __nv_bfloat16 *wx, const __nv_bfloat16 *wn, float *h_out, float *n_out) {
    const int r = threadIdx.x;
    if (r >= ROWS) return;
    const float *xr = x + (size_t)r * H, *hr = h + (size_t)r * H;
    double sx = 0;
    for (int k = 0; k < H; ++k) sx += (double)xr[k] * xr[k];
    const float rx = (float)(1.0 / sqrt(sx / H + EPS));
    double sh = 0;
    for (int k = 0; k < H; ++k) {
        const float v = hr[k] + rx * xr[k] * __bfloat162float(wx[k]);
        h_out[(size_t)r * H + k] = v;
        sh += (double)v * v;
    }
    const float rh = (float)(1.0 / sqrt(sh / H + EPS));
    for (int k = 0; k < H; ++k) n_out[(size_t)r * H + k] = rh * h_out[(size_t)r * H + k] * __bfloat162float(wn[k]);
}

// The reference chain of the first `phases` phases from x0, in f32 from the bf16-rounded inputs the
// kernels stage; with nm.on, the norm phases' inputs through ref_norm: QKV(x0), o_proj, norm,
// gate/up, down, norm, QKV, ... Leaves the last down's output in ref[3] (phases a multiple of 4).
// ref: four [BUF] scratch buffers; scratch: three [ROWS, H] ones.
template <typename WeightOf>
const float *reference_chain(cudaStream_t st, WeightOf weight, const Norms &nm, const float *x0, int phases, float *const ref[4], float *const scratch[3]) {
    const float *h = x0;
    int hi = 0;
    return reference_phases(st, weight, x0, phases, ref, [&](int p, const float *x) {
        if (!norm_phase(nm, p)) return x;
        const NormWeights w = norm_weights(nm, p);
        ref_norm<<<1, ROWS, 0, st>>>(x, h, w.x, w.n, scratch[hi], scratch[2]);
        h = scratch[hi];
        hi ^= 1;
        return (const float *)scratch[2];
    });
}
