// Probe (nvcc, on the device): does decode attention stream K/V faster as bulk copies into a
// shared-memory ring than the library's one-query kernel does with register loads? At W 64 / 256
// the decode step's attention is 42 / 60 % of its kernel time (session 18), reading ≈ 136 / 545 MB
// a launch at ≈ 2.8 / 3.5 TB/s; tools/ring_probe.cu (session 24) streamed weights at 4.2 TB/s with
// 8 KB bulk copies into a ring of stages when nothing waited on them.
//
// Here one block takes one (row, key split) and all 16 heads: with the cache laid out
// [block, position, head, D] the K (and V) of 4 consecutive positions of a page is one contiguous
// 16 KB run, so a producer warp copies a stage (K and V of 4 positions, 32 KB) with two
// `cp.async.bulk` into a ring of `depth` stages; eight consumer warps (two heads each, 16 lanes
// a head, 8 dims a lane) read every stage, score, run the online softmax (base 2) and accumulate
// V, then release the stage (an mbarrier of 8 arrivals). Several splits write the library's
// partials (acc, max, sum) and its combine kernel merges them. Session 19 staged K/V for groups of
// 8 heads with a copy per position (2 KB) and lost; the differences here are 16 KB copies and up
// to 128 KB in flight a block.
//
// The library's kernels are compiled into this file (src/ops/kernels/paged_attention.cu), so both
// run in one process on the same caches: the one-query kernel with the library's plan for a
// captured graph (attention_split.rs, repeated here: the bound is the next power of two of the
// context, at least 256) and its other build, against the ring over splits and depths. Each variant
// is a graph of 96 launches over 24 layers' caches (a step's worth; caches never hot in L2);
// outputs are checked against the library's.
//
//     nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn && /tmp/attn [ctx|var [widths]]
//
// Since session 24's device calls it also times the library's own ring kernel
// (paged_decode_ring_*, keys cut in proportion to each row's context) and takes `var`: the
// depth-batching benchmark's varied context lengths.
#include "probe_ptx.cuh"
#include "../src/ops/kernels/paged_attention.cu"
#include <algorithm>
#include <math.h>
#include <random>
#include <string>
#include <vector>

namespace ring {

constexpr int HEADS = 16, HD = 128, BS = 16;          // Ouro-1.4B: 16 heads, no GQA; pages of 16
constexpr int POS_BYTES = HEADS * HD * 2;              // one position's K (or V): 4 KB
constexpr int CP = 4;                                  // positions a stage
constexpr int HALF = CP * POS_BYTES;                   // a stage's K (then V): 16 KB
constexpr int CWARPS = 8, THREADS = (CWARPS + 1) * 32;
constexpr int MAX_DEPTH = 4;

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t ok = 0;
    while (!ok)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// grid (rows, splits); one query a row at the end of its context (decode), all keys visible.
// splits == 1 writes out; otherwise partials in the library's layout for paged_attn_combine.
__global__ void __launch_bounds__(THREADS) attn_ring(__nv_bfloat16 *out, float *ws_acc, float *ws_ml, const __nv_bfloat16 *q,
                                                     const __nv_bfloat16 *kc, const __nv_bfloat16 *vc, const uint32_t *tables,
                                                     const uint32_t *ctx_lens, int rows, int max_blocks, float scale_log2, int depth) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) uint64_t full[MAX_DEPTH], empty[MAX_DEPTH];
    const int row = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int ctx = (int)ctx_lens[row];
    // Chunks of whole stages; the last split may hold fewer keys or none.
    const int chunk = ((ctx + splits - 1) / splits + CP - 1) / CP * CP;
    const int k0 = min(ctx, split * chunk), k1 = min(ctx, k0 + chunk);
    const int nstages = (k1 - k0 + CP - 1) / CP;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        for (int i = 0; i < depth; ++i) {
            mbar_init(smem_addr(&full[i]), 1);
            mbar_init(smem_addr(&empty[i]), CWARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const uint32_t *table = tables + (size_t)row * max_blocks;
    if (warp == CWARPS) {  // producer
        if (lane == 0) {
            for (int i = 0; i < nstages; ++i) {
                const int s = i % depth, round = i / depth;
                if (round > 0) mbar_wait(smem_addr(&empty[s]), (round - 1) & 1);
                const int p = k0 + i * CP, n = min(CP, k1 - p);
                const size_t slot = (size_t)__ldg(table + p / BS) * BS + p % BS;  // 4 | 16: a stage stays in one page
                const uint32_t bar = smem_addr(&full[s]);
                mbar_expect_tx(bar, 2u * n * POS_BYTES);
                unsigned char *st = smem + (size_t)s * 2 * HALF;
                bulk_g2s(smem_addr(st), kc + slot * HEADS * HD, n * POS_BYTES, bar);
                bulk_g2s(smem_addr(st + HALF), vc + slot * HEADS * HD, n * POS_BYTES, bar);
            }
        }
        return;
    }
    const int head = 2 * warp + (lane >> 4), l16 = lane & 15;
    float qv[8], acc[8];
    {
        const uint4 raw = *reinterpret_cast<const uint4 *>(q + ((size_t)row * HEADS + head) * HD + 8 * l16);
        const __nv_bfloat162 *h2 = reinterpret_cast<const __nv_bfloat162 *>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(h2[i]);
            qv[2 * i] = f.x * scale_log2;
            qv[2 * i + 1] = f.y * scale_log2;
        }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    float m = -INFINITY, l = 0.f;
    const int off = head * HD + 8 * l16;  // elements within a position
    for (int i = 0; i < nstages; ++i) {
        const int s = i % depth;
        mbar_wait(smem_addr(&full[s]), (i / depth) & 1);
        const __nv_bfloat16 *ks = reinterpret_cast<const __nv_bfloat16 *>(smem + (size_t)s * 2 * HALF);
        const __nv_bfloat16 *vs = ks + HALF / 2;
        const int n = min(CP, k1 - (k0 + i * CP));
        uint4 kr[CP], vr[CP];
#pragma unroll
        for (int j = 0; j < CP; ++j) {
            if (j < n) {
                kr[j] = *reinterpret_cast<const uint4 *>(ks + j * HEADS * HD + off);
                vr[j] = *reinterpret_cast<const uint4 *>(vs + j * HEADS * HD + off);
            }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_addr(&empty[s]));
        float sc[CP];
#pragma unroll
        for (int j = 0; j < CP; ++j) {
            float d = 0.f;
            if (j < n) {
                const __nv_bfloat162 *h2 = reinterpret_cast<const __nv_bfloat162 *>(&kr[j]);
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const float2 f = __bfloat1622float2(h2[t]);
                    d = fmaf(qv[2 * t], f.x, d);
                    d = fmaf(qv[2 * t + 1], f.y, d);
                }
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            sc[j] = j < n ? d : -INFINITY;
        }
        float mx = m;
#pragma unroll
        for (int j = 0; j < CP; ++j) mx = fmaxf(mx, sc[j]);
        const float alpha = exp2f(m - mx);  // m = -inf the first time: alpha 0
        m = mx;
        l *= alpha;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= alpha;
#pragma unroll
        for (int j = 0; j < CP; ++j) {
            if (j < n) {
                const float pr = exp2f(sc[j] - mx);
                l += pr;
                const __nv_bfloat162 *h2 = reinterpret_cast<const __nv_bfloat162 *>(&vr[j]);
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    const float2 f = __bfloat1622float2(h2[t]);
                    acc[2 * t] = fmaf(pr, f.x, acc[2 * t]);
                    acc[2 * t + 1] = fmaf(pr, f.y, acc[2 * t + 1]);
                }
            }
        }
    }
    const size_t th = (size_t)row * HEADS + head;
    if (splits == 1) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        uint4 o;
        uint32_t *o32 = reinterpret_cast<uint32_t *>(&o);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * t] * inv, acc[2 * t + 1] * inv);
            o32[t] = *reinterpret_cast<uint32_t *>(&h);
        }
        *reinterpret_cast<uint4 *>(out + th * HD + 8 * l16) = o;
    } else {
        const size_t sth = (size_t)split * rows * HEADS + th;
        if (l > 0.f) {
            float4 *a = reinterpret_cast<float4 *>(ws_acc + sth * HD + 8 * l16);
            a[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            a[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
        if (l16 == 0) {
            ws_ml[sth * 2] = m;
            ws_ml[sth * 2 + 1] = l;
        }
    }
}

}  // namespace ring

// The library's split plan (attention_split.rs `plan`, same arithmetic) for a launch whose
// contexts are bounded by `bound` (a graph's bucket), base = (row tile, kv head) blocks.
struct Plan { int splits, chunk, wave; bool occ7; };
static int keys_per_block(int max_ctx, int splits, int step) { return ((max_ctx + splits - 1) / splits + step - 1) / step * step; }
static int host_split_count(int max_ctx, int max_splits, int base, int wave, int step) {
    long long best = -1;
    int bs = 1;
    for (int s = 1; s <= max_splits; ++s) {
        const int chunk = keys_per_block(max_ctx, s, step);
        if (s > 1 && (long long)chunk * (s - 1) >= max_ctx) break;
        const long long cost = ((long long)base * s + wave - 1) / wave * (chunk + step);
        if (best < 0 || cost < best) { best = cost; bs = s; }
    }
    return bs;
}
static Plan library_plan(int bound, int base, int sms, int wave_plain, int wave_occ7) {
    const int step = 32, typical = bound - bound / 4, target = 8 * sms;
    int splits = 1;
    if (base < target && bound >= 256) splits = std::max(1, std::min(std::min((target + base - 1) / base, bound / 64), 32));
    if (splits == 1) return {1, 0x7fffffff, 1, typical <= 384};
    const int chunk = keys_per_block(bound, splits, 64);
    if (chunk <= 512) return {(bound + chunk - 1) / chunk, chunk, 1, std::min(chunk, typical) <= 384};
    int wave = wave_plain;
    splits = host_split_count(bound, 32, base, wave, step);
    const bool occ7 = keys_per_block(typical, splits, step) <= 384;
    if (occ7) {
        wave = wave_occ7;
        splits = host_split_count(bound, 32, base, wave, step);
    }
    return splits == 1 ? Plan{1, 0x7fffffff, 1, occ7} : Plan{splits, 0, wave, occ7};
}

int main(int argc, char **argv) {
    using namespace ring;
    // A context for every row, or `var`: the depth-batching benchmark's lengths (lognormal prompt,
    // median 128, sigma 0.9, 8..512, plus 0..255 tokens decoded), where the ring with one split
    // count for every row was slow in the library (session 24).
    const bool varied = argc > 1 && std::string(argv[1]) == "var";
    const int ctx = argc > 1 && !varied ? atoi(argv[1]) : varied ? 768 : 260;  // the longest
    std::vector<int> widths;
    for (std::string w = argc > 2 ? argv[2] : "16,64,256"; !w.empty();) {
        const size_t c = w.find(',');
        widths.push_back(atoi(w.substr(0, c).c_str()));
        w = c == std::string::npos ? "" : w.substr(c + 1);
    }
    int BOUND = 256;
    while (BOUND < ctx) BOUND *= 2;
    const int LAYERS = 24, LAUNCHES = 96;
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaFuncSetAttribute(attn_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, MAX_DEPTH * 2 * HALF));
    CK(cudaFuncSetAttribute(paged_decode_ring_bf16_d128, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * 2 * HALF));
    printf("SMs %d, context %s%d, graph bound %d\n", sms, varied ? "varied, at most " : "", ctx, BOUND);
    for (int depth = 2; depth <= MAX_DEPTH; ++depth) {
        int per_sm;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, attn_ring, THREADS, depth * 2 * HALF));
        printf("ring depth %d (%d KB): %d blocks an SM\n", depth, depth * 2 * HALF / 1024, per_sm);
    }
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const float scale_log2 = 1.f / sqrtf((float)HD) * 1.4426950408889634f;
    int occ_plain, occ7;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_plain, paged_attn_bf16_d128_q1, NTHREADS, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ7, paged_attn_bf16_d128_q1_o7, NTHREADS, 0));
    for (int W : widths) {
        const Plan plan = library_plan(BOUND, W * HEADS, sms, sms * occ_plain, sms * occ7);
        printf("W %3d: library plan %d split%s, chunk %d (0: cut in the kernel for a wave of %d), %s build\n", W, plan.splits,
               plan.splits > 1 ? "s" : "", plan.chunk == 0x7fffffff ? -1 : plan.chunk, plan.wave, plan.occ7 ? "7-block" : "plain");
        std::vector<uint32_t> lens(W, ctx);
        if (varied) {
            std::mt19937 g(1000 + W);
            std::lognormal_distribution<double> prompt(log(128.0), 0.9);
            for (auto &c : lens) c = (uint32_t)std::min(512.0, std::max(8.0, std::round(prompt(g)))) + g() % 256;
        }
        const int max_blocks = (BOUND + BS - 1) / BS, used = (ctx + BS - 1) / BS;
        const size_t pool = (size_t)W * used;  // pages a layer (every row's table room for the longest)
        const size_t page_elems = (size_t)BS * HEADS * HD;
        std::vector<__nv_bfloat16 *> kc(LAYERS), vc(LAYERS);
        for (int l = 0; l < LAYERS; ++l) {
            CK(cudaMalloc(&kc[l], pool * page_elems * 2));
            CK(cudaMalloc(&vc[l], pool * page_elems * 2));
            fill<<<1024, 256, 0, st>>>(kc[l], pool * page_elems, 7 * l + 1, 2.f);
            fill<<<1024, 256, 0, st>>>(vc[l], pool * page_elems, 7 * l + 2, 2.f);
        }
        std::vector<uint32_t> perm(pool), tab((size_t)W * max_blocks, 0), cu(W + 1);
        for (size_t i = 0; i < pool; ++i) perm[i] = (uint32_t)i;
        std::shuffle(perm.begin(), perm.end(), std::mt19937(W));
        for (int r = 0; r < W; ++r)
            for (int b = 0; b < used; ++b) tab[(size_t)r * max_blocks + b] = perm[(size_t)r * used + b];
        for (int r = 0; r <= W; ++r) cu[r] = r;
        uint32_t *d_tab, *d_lens, *d_cu;
        __nv_bfloat16 *q, *out_lib, *out_ring;
        float *ws_acc, *ws_ml;
        CK(cudaMalloc(&d_tab, tab.size() * 4));
        CK(cudaMalloc(&d_lens, W * 4));
        CK(cudaMalloc(&d_cu, (W + 1) * 4));
        CK(cudaMemcpy(d_tab, tab.data(), tab.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_lens, lens.data(), W * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(d_cu, cu.data(), (W + 1) * 4, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&q, (size_t)W * HEADS * HD * 2));
        fill<<<64, 256, 0, st>>>(q, (size_t)W * HEADS * HD, 99, 2.f);
        CK(cudaMalloc(&out_lib, (size_t)W * HEADS * HD * 2));
        CK(cudaMalloc(&out_ring, (size_t)W * HEADS * HD * 2));
        CK(cudaMalloc(&ws_acc, (size_t)32 * W * HEADS * HD * 4));
        CK(cudaMalloc(&ws_ml, (size_t)32 * W * HEADS * 2 * 4));
        CK(cudaStreamSynchronize(st));
        // The library's kernel: grid (rows, kv heads, splits), chunk as its plan passes it.
        auto lib = [&](int l, bool occ7, int splits, int chunk, __nv_bfloat16 *o, int wave = 1) {
            dim3 grid(W, HEADS, splits);
            float *a = splits > 1 ? ws_acc : nullptr, *mlp = splits > 1 ? ws_ml : nullptr;
            if (occ7)
                paged_attn_bf16_d128_q1_o7<<<grid, NTHREADS, 0, st>>>(o, a, mlp, q, kc[l], vc[l], d_tab, d_lens, d_cu, W, max_blocks, HEADS, HEADS, BS, 4, scale_log2, 1, splits, chunk, wave, W);
            else
                paged_attn_bf16_d128_q1<<<grid, NTHREADS, 0, st>>>(o, a, mlp, q, kc[l], vc[l], d_tab, d_lens, d_cu, W, max_blocks, HEADS, HEADS, BS, 4, scale_log2, 1, splits, chunk, wave, W);
            if (splits > 1) paged_attn_combine_bf16_d128<<<dim3(W, HEADS), HD, 0, st>>>(o, ws_acc, ws_ml, splits, W, HEADS);
        };
        // The library's ring kernel as src/ops/cuda/attention.rs launches it (`ring_splits`,
        // RING_DEPTH 2 stages of 32 KB, target = SMs): keys cut in proportion to each row's context.
        const int lib_ring_splits = W >= sms ? 1 : std::min(32, std::max(1, 4 * sms / W));
        auto lib_ring = [&](int l, __nv_bfloat16 *o) {
            paged_decode_ring_bf16_d128<<<dim3(W, lib_ring_splits), (HEADS / 2 + 1) * 32, 2 * 2 * HALF, st>>>(
                o, ws_acc, ws_ml, q, kc[l], vc[l], d_tab, d_lens, d_cu, max_blocks, HEADS, HEADS, BS, scale_log2, W, 2, sms);
            if (lib_ring_splits > 1) paged_attn_combine_bf16_d128<<<dim3(W, HEADS), HD, 0, st>>>(o, ws_acc, ws_ml, lib_ring_splits, W, HEADS);
        };
        auto rng = [&](int l, int splits, int depth, __nv_bfloat16 *o) {
            attn_ring<<<dim3(W, splits), THREADS, depth * 2 * HALF, st>>>(o, ws_acc, ws_ml, q, kc[l], vc[l], d_tab, d_lens, W, max_blocks, scale_log2, depth);
            if (splits > 1) paged_attn_combine_bf16_d128<<<dim3(W, HEADS), HD, 0, st>>>(o, ws_acc, ws_ml, splits, W, HEADS);
        };
        double keys = 0;
        for (auto c : lens) keys += c;
        const double mb = keys * POS_BYTES * 2 / 1e6;
        auto time = [&](const std::string &name, auto launch) {
            cudaGraph_t gr;
            cudaGraphExec_t ex;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < LAUNCHES; ++i) launch(i % LAYERS);
            CK(cudaStreamEndCapture(st, &gr));
            CK(cudaGraphInstantiate(&ex, gr, 0));
            CK(cudaGraphLaunch(ex, st));
            std::vector<float> ts;
            for (int i = 0; i < 7; ++i) {
                CK(cudaEventRecord(e0, st));
                CK(cudaGraphLaunch(ex, st));
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms;
                CK(cudaEventElapsedTime(&ms, e0, e1));
                ts.push_back(ms);
            }
            std::sort(ts.begin(), ts.end());
            const double us = ts[ts.size() / 2] * 1000.0 / LAUNCHES;
            printf("W %3d ctx %s%d  %-44s %7.2f us a launch  %5.2f TB/s\n", W, varied ? "<" : "", ctx, name.c_str(), us, mb / us);
            CK(cudaGraphExecDestroy(ex));
            CK(cudaGraphDestroy(gr));
        };
        // Check: the ring against the library on layer 0, every split / depth timed below.
        lib(0, plan.occ7, plan.splits, plan.chunk, out_lib, plan.wave);
        CK(cudaStreamSynchronize(st));
        std::vector<__nv_bfloat16> a((size_t)W * HEADS * HD), b(a.size());
        CK(cudaMemcpy(a.data(), out_lib, a.size() * 2, cudaMemcpyDeviceToHost));
        const int split_opts[] = {1, 2, 4, 8, 16, 32};
        double worst = 0;
        for (int s : split_opts)
            for (int d = 2; d <= MAX_DEPTH; ++d) {
                rng(0, s, d, out_ring);
                CK(cudaStreamSynchronize(st));
                CK(cudaMemcpy(b.data(), out_ring, b.size() * 2, cudaMemcpyDeviceToHost));
                double num = 0, den = 0;
                for (size_t i = 0; i < a.size(); ++i) {
                    const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
                    num += (x - y) * (x - y);
                    den += x * x;
                }
                worst = std::max(worst, sqrt(num / std::max(den, 1e-30)));
            }
        printf("W %3d: ring vs library, worst rel err over splits and depths %.2e\n", W, worst);
        {
            lib_ring(0, out_ring);
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(b.data(), out_ring, b.size() * 2, cudaMemcpyDeviceToHost));
            double num = 0, den = 0;
            for (size_t i = 0; i < a.size(); ++i) {
                const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
                num += (x - y) * (x - y);
                den += x * x;
            }
            const double err = sqrt(num / std::max(den, 1e-30));
            printf("W %3d: the library's ring (%d splits in the grid) vs its SIMT kernel: rel err %.2e\n", W, lib_ring_splits, err);
            if (!(err < 1e-2) || !(worst < 1e-2)) {
                printf("W %3d: ring output differs from the library's SIMT kernel\n", W);
                return 1;
            }
        }
        for (int rep = 0; rep < 2; ++rep) {
            time("library, its plan", [&](int l) { lib(l, plan.occ7, plan.splits, plan.chunk, out_lib, plan.wave); });
            time(plan.occ7 ? "library, its plan, plain build" : "library, its plan, 7-block build",
                 [&](int l) { lib(l, !plan.occ7, plan.splits, plan.chunk, out_lib, plan.wave); });
            time("library's ring (proportional splits)", [&](int l) { lib_ring(l, out_ring); });
            for (int s : split_opts) {
                if ((long long)W * s > 8 * sms) continue;
                for (int d = 2; d <= MAX_DEPTH; ++d) {
                    char name[64];
                    snprintf(name, sizeof name, "ring, %d split%s, %d x 32 KB", s, s > 1 ? "s" : "", d);
                    time(name, [&](int l) { rng(l, s, d, out_ring); });
                }
            }
        }
        for (int l = 0; l < LAYERS; ++l) {
            CK(cudaFree(kc[l]));
            CK(cudaFree(vc[l]));
        }
        CK(cudaFree(d_tab));
        CK(cudaFree(d_lens));
        CK(cudaFree(d_cu));
        CK(cudaFree(q));
        CK(cudaFree(out_lib));
        CK(cudaFree(out_ring));
        CK(cudaFree(ws_acc));
        CK(cudaFree(ws_ml));
    }
    return 0;
}
