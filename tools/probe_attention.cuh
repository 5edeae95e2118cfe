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
    }
};
