// The library's decode attention as one node of the probes' layer chain (tools/ring_probe.cu's
// `compare`, session 32): at 16 rows of Ouro-1.4B shapes and a context of 260 keys the library runs
// the one-query SIMT kernel with qkv_rope_write folded in, 8 warps a block, unsplit (attention_split:
// one even wave of 256 (row, head) blocks), `paged_attn_rope_bf16_d128_q1_w8` from
// src/ops/kernels/paged_attention.cu. Each of the 24 layers has its own paged caches (pages of 16
// positions scattered over the pool, as a served batch's are); a launch rotates q and the newest
// k out of the fused projection, writes the newest K / V and attends over every row's keys.
#pragma once
#include "probe_chain.cuh"
#include "../src/ops/kernels/paged_attention.cu"
#include <random>

struct DecodeAttention {
    static constexpr int HEADS = 16, HD = 128, BS = 16, CTX = 260, BUCKET = 512;  // a graph's context bound
    cudaStream_t st;
    __nv_bfloat16 *kc[L], *vc[L], *cs;
    uint32_t *tab, *lens, *cu, *slots;
    int max_blocks;
    long long num_slots;
    float scale_log2;

    explicit DecodeAttention(cudaStream_t stream) : st(stream) {
        const int used = (CTX + BS - 1) / BS;
        max_blocks = BUCKET / BS;
        const size_t pool = (size_t)ROWS * used, page = (size_t)BS * HEADS * HD;
        num_slots = (long long)pool * BS;
        for (int l = 0; l < L; ++l) {
            CK(cudaMalloc(&kc[l], pool * page * 2));
            CK(cudaMalloc(&vc[l], pool * page * 2));
            fill<<<1024, 256, 0, st>>>(kc[l], pool * page, 7 * l + 1, 2.f);
            fill<<<1024, 256, 0, st>>>(vc[l], pool * page, 7 * l + 2, 2.f);
        }
        std::vector<uint32_t> perm(pool), t((size_t)ROWS * max_blocks, 0), c(ROWS + 1), n(ROWS, CTX), s(ROWS);
        for (size_t i = 0; i < pool; ++i) perm[i] = (uint32_t)i;
        std::shuffle(perm.begin(), perm.end(), std::mt19937(ROWS));
        for (int r = 0; r < ROWS; ++r)
            for (int b = 0; b < used; ++b) t[(size_t)r * max_blocks + b] = perm[(size_t)r * used + b];
        for (int r = 0; r <= ROWS; ++r) c[r] = r;
        for (int r = 0; r < ROWS; ++r) s[r] = t[(size_t)r * max_blocks + (CTX - 1) / BS] * BS + (CTX - 1) % BS;  // the newest position's slot
        auto upload = [&](uint32_t *&d, const std::vector<uint32_t> &h) {
            CK(cudaMalloc(&d, h.size() * 4));
            CK(cudaMemcpyAsync(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice, st));
        };
        upload(tab, t), upload(cu, c), upload(lens, n), upload(slots, s);
        CK(cudaMalloc(&cs, (size_t)ROWS * HD * 2));  // cos [ROWS, HD/2], then sin
        fill<<<64, 256, 0, st>>>(cs, (size_t)ROWS * HD, 777, 2.f);
        scale_log2 = 1.f / sqrtf((float)HD) * 1.4426950408889634f;
        CK(cudaStreamSynchronize(st));  // the host vectors go out of scope
    }

    // out [ROWS, HEADS * HD] = attention of layer l's caches with the queries of qkv [ROWS, 3 * HEADS * HD].
    void launch(int l, const __nv_bfloat16 *qkv, __nv_bfloat16 *out) const {
        const int q_stride = 3 * HEADS * HD;
        paged_attn_rope_bf16_d128_q1_w8<<<dim3(ROWS, HEADS, 1), W8_WARPS * 32, 0, st>>>(
            out, nullptr, nullptr, qkv, kc[l], vc[l], tab, lens, cu, ROWS, max_blocks, HEADS, HEADS, BS, 4, scale_log2, 1, 1, 0x7fffffff, 1, ROWS,
            cs, cs + ROWS * HD / 2, slots, kc[l], vc[l], num_slots, q_stride);
        CK(cudaGetLastError());  // a bad launch inside a capture surfaces here, not at EndCapture
    }

    // One eager launch on layer 0 against a host reference (also loads the kernel before any
    // capture): every (row, head) output — q rotated with cos / sin, keys 0..CTX-2 through the
    // block table, the newest key and value from qkv — and the newest K / V written at each row's
    // slot. The output's relative error (rms) is returned; the cache writes must match the
    // reference's bf16 rounding to within one bf16 ulp (exact up to FMA contraction).
    double check(const __nv_bfloat16 *qkv) const {
        const size_t pool = (size_t)num_slots / BS, n_cache = pool * BS * HEADS * HD, width = 3 * HEADS * HD;
        std::vector<__nv_bfloat16> k(n_cache), v(n_cache), x(ROWS * width), c((size_t)ROWS * HD), o((size_t)ROWS * HEADS * HD);
        std::vector<uint32_t> t((size_t)ROWS * max_blocks), s(ROWS);
        __nv_bfloat16 *out;
        CK(cudaMalloc(&out, o.size() * 2));
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(k.data(), kc[0], n_cache * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(v.data(), vc[0], n_cache * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(x.data(), qkv, x.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(c.data(), cs, c.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(t.data(), tab, t.size() * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(s.data(), slots, s.size() * 4, cudaMemcpyDeviceToHost));
        launch(0, qkv, out);
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(o.data(), out, o.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaFree(out));
        auto f = [](__nv_bfloat16 b) { return __bfloat162float(b); };
        auto rope = [&](const __nv_bfloat16 *h, int r, float *y) {  // split-half, rounded to bf16 as the kernel rounds
            for (int i = 0; i < HD / 2; ++i) {
                const float x1 = f(h[i]), x2 = f(h[i + HD / 2]), co = f(c[(size_t)r * HD / 2 + i]), si = f(c[(size_t)ROWS * HD / 2 + (size_t)r * HD / 2 + i]);
                y[i] = f(__float2bfloat16(x1 * co - x2 * si));
                y[i + HD / 2] = f(__float2bfloat16(x1 * si + x2 * co));
            }
        };
        double num = 0, den = 0;
        int bad_writes = 0;
        std::vector<double> p(CTX);
        for (int r = 0; r < ROWS; ++r) {
            for (int h = 0; h < HEADS; ++h) {
                float q[HD], kn[HD], vn[HD];
                const __nv_bfloat16 *row = x.data() + (size_t)r * width;
                rope(row + (size_t)h * HD, r, q);
                rope(row + (size_t)(HEADS + h) * HD, r, kn);
                for (int e = 0; e < HD; ++e) vn[e] = f(row[(size_t)(2 * HEADS + h) * HD + e]);
                auto at = [&](int pos) { return ((size_t)t[(size_t)r * max_blocks + pos / BS] * BS + pos % BS) * HEADS * HD + (size_t)h * HD; };
                double mx = -1e300;
                for (int j = 0; j < CTX; ++j) {
                    double d = 0;
                    for (int e = 0; e < HD; ++e) d += (double)q[e] * (j == CTX - 1 ? kn[e] : f(k[at(j) + e]));
                    p[j] = d / sqrt((double)HD);
                    mx = std::max(mx, p[j]);
                }
                double sum = 0;
                for (int j = 0; j < CTX; ++j) sum += (p[j] = exp(p[j] - mx));
                for (int e = 0; e < HD; ++e) {
                    double a = 0;
                    for (int j = 0; j < CTX; ++j) a += p[j] * (j == CTX - 1 ? vn[e] : f(v[at(j) + e]));
                    const double want = a / sum, got = f(o[((size_t)r * HEADS + h) * HD + e]);
                    num += (got - want) * (got - want);
                    den += want * want;
                }
                // The newest key and value as written (read back below, one row-head at a time).
                __nv_bfloat16 wk[HD], wv[HD];
                const size_t w = (size_t)s[r] * HEADS * HD + (size_t)h * HD;
                CK(cudaMemcpy(wk, kc[0] + w, HD * 2, cudaMemcpyDeviceToHost));
                CK(cudaMemcpy(wv, vc[0] + w, HD * 2, cudaMemcpyDeviceToHost));
                for (int e = 0; e < HD; ++e) {
                    const float ulp = fabsf(kn[e]) / 128.f + 1e-30f;
                    if (fabsf(f(wk[e]) - kn[e]) > ulp || f(wv[e]) != vn[e]) ++bad_writes;
                }
            }
        }
        const double err = sqrt(num / std::max(den, 1e-30));
        printf("decode attention (paged_attn_rope_bf16_d128_q1_w8, layer 0) against the host reference: rel err %.2e (|ref| rms %.4f), %d cache writes off\n", err,
               sqrt(den / ((double)ROWS * HEADS * HD)), bad_writes);
        return bad_writes ? 1.0 : err;
    }
};
