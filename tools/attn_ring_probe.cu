// Probe (nvcc, on the device): does decode attention stream K/V faster as bulk copies into a
// shared-memory ring than the library's one-query kernel does with register loads? At W 64 / 256
// the decode step's attention is 42 / 60 % of its kernel time (session 18), reading ≈ 136 / 545 MB
// a launch at ≈ 2.8 / 3.5 TB/s; tools/ring_probe.cu (session 24) streamed weights at 4.2 TB/s with
// 8 KB bulk copies into a ring of stages when nothing waited on them.
//
// The ring kernel (now the library's `paged_decode_ring_*`, src/ops/kernels/paged_attention.cu):
// a block takes all 16 heads of a run of stages — with the cache laid out [block, position, head,
// D] the K (and V) of 4 consecutive positions of a page is one contiguous 16 KB run, so a producer
// warp copies a stage (K and V of 4 positions, 32 KB) with two `cp.async.bulk` into a ring of
// `depth` stages; eight consumer warps (two heads each) score, run the online softmax and
// accumulate V out of it. The launch's stages, rows end to end, are cut into one equal run a block
// of a fixed grid (blocks an SM x SMs); runs cross rows, and rows cut between blocks are merged
// by the ring's combine kernel. Session 19 staged K/V for groups of 8 heads with a copy per
// position (2 KB) and lost; the differences here are 16 KB copies and up to 128 KB in flight a
// block.
//
// The library's kernels are compiled into this file, so all run in one process on the same
// caches: the SIMT one-query kernel with the library's plan for a captured graph
// (attention_split.rs, repeated here: the bound is the next power of two of the context, at least
// 256) and its other build; the ring as the library launches it (LIB_* below); and the ring swept
// over blocks an SM, depths and the fewest stages a run takes. Each variant is a graph of 96
// launches over 24 layers' caches (a step's worth; caches never hot in L2); outputs are checked
// against the SIMT kernel's (the run fails past 1e-2).
//
//     nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/attn_ring_probe.cu -o /tmp/attn && /tmp/attn [ctx|var [widths [brief]]]
//
// Session 27 measured two consumer variants here and dropped them (one head a consumer warp:
// 2-5 % slower; the rescale skipped where the running maximum did not grow: level). `brief`
// (third argument) skips the sweep and times where a launch's fixed cost goes instead: the ring
// without its combine, the combine alone, an empty kernel in the same chain of 96, and the
// library's qkv_rope_write (the kernel before attention) alone and chained with the ring or the
// SIMT plan. Session 27 also ran, through such chains, programmatic dependent launch into the
// ring (its set-up and every stage but a row's last before griddepcontrol.wait) and into both
// combines: nothing gained (docs/BENCHMARKS.md, raw-2026-12-07). `brief` also checks the ring with
// qkv_rope_write folded in (the library's paged_decode_ring_rope_*) against qkv_rope_write + the
// ring, with the newest slots poisoned first, and times both.
//
// `var`: the depth-batching benchmark's varied context lengths. Session 24 ran earlier versions:
// one split count for every row (b29c86f), then splits in proportion to each row's context
// (4f57870) — both slow with varied contexts, the second also with even ones.
#include "probe_ptx.cuh"
#ifdef RING_TIMELINE
// The ring's timeline (built with -DRING_TIMELINE): a globaltimer stamp a block at each RING_MARK
// point of paged_attention.cu — 0 start, 1 set-up done, 2 first copy issued, 3 first stage in
// (consumer warp 0), 4 consumers done, 5 producer done — written while g_mark_on.
__device__ unsigned long long g_marks[4096][6];
__device__ int g_mark_on;
#define RING_MARK(cond, point)                                                     \
    do {                                                                           \
        if ((cond) && g_mark_on) {                                                 \
            unsigned long long t_;                                                 \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_));                 \
            g_marks[blockIdx.x][point] = t_;                                       \
        }                                                                          \
    } while (0)
#endif
#include "../src/ops/kernels/paged_attention.cu"
#include "../src/ops/kernels/fused.cu"
#include <algorithm>
#include <math.h>

// The one-query kernel with more warps a block (`wide`, session 30): at W 16 a block per (row,
// head) walks all its keys in few steps, so no split and no combine launch. Round 1 (raw
// 2026-12-10 call 1) measured 16 warps (2 an SM, spilling), 8 warps (3 an SM: now the library's
// `_w8` build) and 8 warps held to 4 an SM (now `_w8o4`): the 8-warp build won wherever one wave
// held its blocks, the one held to four at W 32.
// Session 30, round 2: the library's 8-warp builds (`paged_attn_bf16_d128_q1_w8`, `_w8o4`)
// against builds that walk more keys a step (8 / 6 key sets a lane, 2 blocks an SM) or the same
// keys with more warps (16 warps of 2 key sets: faster here, slower in the CB step, not kept).
// Session 31: the 6-key-set build won at one block an SM (W 5-8) and is now the library's `_w8k6`
// (the same instantiation as `w8u6` here).
extern "C" __global__ void __launch_bounds__(256, 2) paged_attn_bf16_d128_q1_w8u8(PA_ARGS(__nv_bfloat16)) {
    paged_attn_impl<__nv_bfloat16, 128, 1, false, 8, 8>(PA_PASS);
}
extern "C" __global__ void __launch_bounds__(256, 2) paged_attn_bf16_d128_q1_w8u6(PA_ARGS(__nv_bfloat16)) {
    paged_attn_impl<__nv_bfloat16, 128, 1, false, 8, 6>(PA_PASS);
}
extern "C" __global__ void __launch_bounds__(512, 2) paged_attn_bf16_d128_q1_w16u2(PA_ARGS(__nv_bfloat16)) {
    paged_attn_impl<__nv_bfloat16, 128, 1, false, 16, 2>(PA_PASS);
}
#include <random>
#include <cstring>
#include <string>
#include <vector>

namespace ring {

constexpr int HEADS = 16, HD = 128, BS = 16;          // Ouro-1.4B: 16 heads, no GQA; pages of 16
constexpr int POS_BYTES = HEADS * HD * 2;              // one position's K (or V): 4 KB
constexpr int CP = 4;                                  // positions a stage
constexpr int HALF = CP * POS_BYTES;                   // a stage's K (then V): 16 KB
constexpr int THREADS = (HEADS / 2 + 1) * 32;                // eight consumer warps and the producer
constexpr int MAX_DEPTH = 4;                           // RING_MAX_DEPTH of the library
constexpr int MAX_BLOCKS_PER_SM = 3;                   // the most the sweep puts on an SM
// The library's launch (src/ops/cuda/attention.rs: RING_BLOCKS_PER_SM, RING_DEPTH, RING_MIN_CHUNK).
constexpr int LIB_BLOCKS_PER_SM = 1, LIB_DEPTH = 2, LIB_MIN_CHUNK = 8;
}  // namespace ring

// A launch's floor in a chain of kernels: no work at all, the ring's grid and threads.
__global__ void empty_kernel() {}

// The library's split plan for its 4-warp builds (attention_split.rs `plan`, same arithmetic,
// without the unsplit 8-warp builds it now prefers for one even wave of two to four blocks an SM
// and, since session 31, for launches of one block an SM on most SMs: those are the `wide`
// variants below) for a launch whose contexts are bounded by `bound` (a
// graph's bucket), base = (row tile, kv head) blocks.
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
    const bool brief = argc > 3 && std::string(argv[3]) == "brief";
    const bool wide_only = argc > 3 && std::string(argv[3]) == "wide";
    CK(cudaFuncSetAttribute(paged_decode_ring_bf16_d128, cudaFuncAttributeMaxDynamicSharedMemorySize, MAX_DEPTH * 2 * HALF));
    CK(cudaFuncSetAttribute(paged_decode_ring_rope_bf16_d128, cudaFuncAttributeMaxDynamicSharedMemorySize, MAX_DEPTH * 2 * HALF));
    printf("SMs %d, context %s%d, graph bound %d\n", sms, varied ? "varied, at most " : "", ctx, BOUND);
    int ring_fit[MAX_DEPTH + 1] = {};
    for (int depth = 2; depth <= MAX_DEPTH; ++depth) {
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ring_fit[depth], paged_decode_ring_bf16_d128, THREADS, depth * 2 * HALF));
        ring_fit[depth] = std::min(ring_fit[depth], MAX_BLOCKS_PER_SM);
        printf("ring depth %d (%d KB): %d blocks an SM\n", depth, depth * 2 * HALF / 1024, ring_fit[depth]);
    }
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const float scale_log2 = 1.f / sqrtf((float)HD) * 1.4426950408889634f;
    int occ_plain, occ7;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_plain, paged_attn_bf16_d128_q1, NTHREADS, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ7, paged_attn_bf16_d128_q1_o7, NTHREADS, 0));
    // Wide builds: {kernel, threads, name}.
    struct WideBuild { void (*fn)(PA_ARGS(__nv_bfloat16)); int threads; const char *name; int occ; };
    std::vector<WideBuild> wides = {
        {paged_attn_bf16_d128_q1_w8, 256, "8 warps (library)", 0},
        {paged_attn_bf16_d128_q1_w8u8, 256, "8 warps, 8 key sets, 2 an SM", 0},
        {paged_attn_bf16_d128_q1_w8u6, 256, "8 warps, 6 key sets, 2 an SM (= _w8k6)", 0},
        {paged_attn_bf16_d128_q1_w16u2, 512, "16 warps, 2 key sets", 0},
        {paged_attn_bf16_d128_q1_w8o4, 256, "8 warps held to 4 an SM (library)", 0},
    };
    for (auto &b : wides) {
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b.occ, b.fn, b.threads, 0));
        printf("wide build %-32s %d blocks an SM\n", b.name, b.occ);
    }
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
        int4 *ws_own;
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
        // Partials: the SIMT kernel's splits x rows, the ring's grid + rows slots.
        const size_t slots = std::max((size_t)32 * W, (size_t)MAX_BLOCKS_PER_SM * sms + W);
        CK(cudaMalloc(&ws_acc, slots * HEADS * HD * 4));
        CK(cudaMalloc(&ws_ml, slots * HEADS * 2 * 4));
        CK(cudaMalloc(&ws_own, (size_t)MAX_BLOCKS_PER_SM * sms * sizeof(int4)));
        // The kernel before attention in the library, qkv_rope_write (q and each row's newest K / V
        // written), on random qkv, cos and sin.
        __nv_bfloat16 *qkv, *cs;
        uint32_t *d_slots;
        CK(cudaMalloc(&qkv, W * 3 * HEADS * HD * 2));
        CK(cudaMalloc(&cs, W * HD * 2));  // cos [W, D/2] then sin
        CK(cudaMalloc(&d_slots, W * 4));
        fill<<<64, 256, 0, st>>>(qkv, W * 3 * HEADS * HD, 4321, 2.f);
        fill<<<64, 256, 0, st>>>(cs, W * HD, 777, 2.f);
        // The library kernel's slot of each row's newest position.
        std::vector<uint32_t> newest(W);
        for (int r = 0; r < W; ++r) newest[r] = tab[(size_t)r * max_blocks + (lens[r] - 1) / BS] * BS + (lens[r] - 1) % BS;
        CK(cudaMemcpy(d_slots, newest.data(), W * 4, cudaMemcpyHostToDevice));
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
        // The ring kernel: a grid of `per_sm` blocks an SM cutting the launch's stages into equal
        // runs of at least `min_chunk`, then (unless left out) its combine, as
        // src/ops/cuda/attention.rs launches them.
        auto rng = [&](int l, int per_sm, int depth, int min_chunk, __nv_bfloat16 *o, bool combine = true) {
            paged_decode_ring_bf16_d128<<<per_sm * sms, THREADS, depth * 2 * HALF, st>>>(
                o, ws_acc, ws_ml, ws_own, q, kc[l], vc[l], d_tab, d_lens, d_cu, W, max_blocks, HEADS, HEADS, BS, scale_log2, depth, min_chunk);
            if (combine) paged_decode_ring_combine_bf16_d128<<<per_sm * sms, 32 * HEADS, 0, st>>>(o, ws_acc, ws_ml, ws_own, d_lens, d_cu, W, HEADS);
        };
        auto lib_ring = [&](int l, __nv_bfloat16 *o) { rng(l, LIB_BLOCKS_PER_SM, LIB_DEPTH, LIB_MIN_CHUNK, o); };
        auto rope_write = [&](int l) {
            const int pairs = 3 * HEADS * HD / 2;
            qkv_rope_write_bf16<<<dim3(W, (pairs + 255) / 256), 256, 0, st>>>(q, kc[l], vc[l], qkv, cs, cs + W * HD / 2, d_slots, HEADS,
                                                                            HEADS, HD, (long long)pool * BS);
        };
        // The ring with qkv_rope_write folded in (the library's paged_decode_ring_rope_*), then the
        // combine.
        auto folded = [&](int l, __nv_bfloat16 *o) {
            paged_decode_ring_rope_bf16_d128<<<LIB_BLOCKS_PER_SM * sms, THREADS, LIB_DEPTH * 2 * HALF, st>>>(
                o, ws_acc, ws_ml, ws_own, q, kc[l], vc[l], d_tab, d_lens, d_cu, W, max_blocks, HEADS, HEADS, BS, scale_log2, LIB_DEPTH,
                LIB_MIN_CHUNK, qkv, cs, cs + W * HD / 2, d_slots, (long long)pool * BS);
            paged_decode_ring_combine_bf16_d128<<<LIB_BLOCKS_PER_SM * sms, 32 * HEADS, 0, st>>>(o, ws_acc, ws_ml, ws_own, d_lens, d_cu, W, HEADS);
        };
        // The wide builds: `max_splits` 1 walks every key in one block; more lets the kernel cut the
        // actual longest context for a wave of its blocks (as Cut::InKernel), then the combine.
        auto wide = [&](int l, const WideBuild &b, __nv_bfloat16 *o) {
            b.fn<<<dim3(W, HEADS, 1), b.threads, 0, st>>>(o, nullptr, nullptr, q, kc[l], vc[l], d_tab, d_lens, d_cu, W, max_blocks, HEADS, HEADS, BS, 4,
                                                    scale_log2, 1, 1, 0x7fffffff, 1, W);
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
            const double us = median_graph_ms(ex, st, 7) * 1000.0 / LAUNCHES;
            printf("W %3d ctx %s%d  %-44s %7.2f us a launch  %5.2f TB/s\n", W, varied ? "<" : "", ctx, name.c_str(), us, mb / us);
            CK(cudaGraphExecDestroy(ex));
            CK(cudaGraphDestroy(gr));
        };
        // Check: the ring against the library on layer 0, every split / depth timed below.
        lib(0, plan.occ7, plan.splits, plan.chunk, out_lib, plan.wave);
        CK(cudaStreamSynchronize(st));
        std::vector<__nv_bfloat16> a((size_t)W * HEADS * HD), b(a.size());
        CK(cudaMemcpy(a.data(), out_lib, a.size() * 2, cudaMemcpyDeviceToHost));
        // Relative error of out_ring (just written) against the SIMT kernel's output `a`.
        auto ring_err = [&] {
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(b.data(), out_ring, b.size() * 2, cudaMemcpyDeviceToHost));
            double num = 0, den = 0;
            for (size_t i = 0; i < a.size(); ++i) {
                const double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
                num += (x - y) * (x - y);
                den += x * x;
            }
            return sqrt(num / std::max(den, 1e-30));
        };
        // (blocks an SM, depth, fewest stages a block) that fit the SM's shared memory.
        struct Shape { int per_sm, depth, min_chunk; };
        std::vector<Shape> shapes;
        for (int d = 2; d <= MAX_DEPTH; ++d)
            for (int b = 1; b <= ring_fit[d]; ++b) shapes.push_back({b, d, LIB_MIN_CHUNK});
        for (int c : {2, 4, 16, 32}) shapes.push_back({LIB_BLOCKS_PER_SM, LIB_DEPTH, c});
        double worst = 0;
        for (const Shape &sh : shapes) {
            rng(0, sh.per_sm, sh.depth, sh.min_chunk, out_ring);
            worst = std::max(worst, ring_err());
        }
        printf("W %3d: ring vs library, worst rel err over grids, depths and chunks %.2e\n", W, worst);
        {
            lib_ring(0, out_ring);
            const double err = ring_err();
            printf("W %3d: the library's ring (%d blocks an SM, depth %d) vs its SIMT kernel: rel err %.2e\n", W, LIB_BLOCKS_PER_SM, LIB_DEPTH, err);
            if (!(err < 1e-2) || !(worst < 1e-2)) {
                printf("W %3d: ring output differs from the library's SIMT kernel\n", W);
                return 1;
            }
            // The same launch again, five times, each after another shape wrote the workspace:
            // the same bits?
            const std::vector<__nv_bfloat16> first = b;
            int differ = 0;
            for (int t = 0; t < 5; ++t) {
                rng(0, 2, 2, 4, out_ring);
                lib_ring(0, out_ring);
                ring_err();
                differ += memcmp(first.data(), b.data(), b.size() * 2) != 0;
            }
            printf("W %3d: the library's ring launched 5 times more: %d differ from the first\n", W, differ);
        }
        {  // The folded ring against qkv_rope_write + the library's ring on layer 0 — its output, and
           // the newest K / V it writes (those slots poisoned first).
            const size_t pe = (size_t)HEADS * HD;
            auto newest_kv = [&]() {
                std::vector<__nv_bfloat16> kv(2 * W * pe);
                CK(cudaStreamSynchronize(st));
                for (int r = 0; r < W; ++r) {
                    CK(cudaMemcpy(kv.data() + r * pe, kc[0] + newest[r] * pe, pe * 2, cudaMemcpyDeviceToHost));
                    CK(cudaMemcpy(kv.data() + (W + r) * pe, vc[0] + newest[r] * pe, pe * 2, cudaMemcpyDeviceToHost));
                }
                return kv;
            };
            rope_write(0);
            lib_ring(0, out_ring);
            ring_err();
            const std::vector<__nv_bfloat16> want = b, want_kv = newest_kv();
            for (int r = 0; r < W; ++r) {
                CK(cudaMemsetAsync(kc[0] + newest[r] * pe, 0xff, pe * 2, st));
                CK(cudaMemsetAsync(vc[0] + newest[r] * pe, 0xff, pe * 2, st));
            }
            folded(0, out_ring);
            ring_err();
            double num = 0, den = 0;
            size_t same = 0;
            for (size_t i = 0; i < b.size(); ++i) {
                const double x = __bfloat162float(want[i]), y = __bfloat162float(b[i]);
                num += (x - y) * (x - y);
                den += x * x;
                same += memcmp(&want[i], &b[i], 2) == 0;
            }
            const std::vector<__nv_bfloat16> got_kv = newest_kv();
            const bool kv_same = memcmp(want_kv.data(), got_kv.data(), got_kv.size() * 2) == 0;
            printf("W %3d: ring with qkv_rope_write folded in vs qkv_rope_write + ring: rel err %.2e, %.1f %% of outputs bit-identical; newest K/V written %s\n",
                   W, sqrt(num / std::max(den, 1e-30)), 100.0 * same / b.size(), kv_same ? "bit-identical" : "DIFFER");
        }
        if (wide_only) {
            lib(0, plan.occ7, plan.splits, plan.chunk, out_lib, plan.wave);  // q changed above: again
            CK(cudaStreamSynchronize(st));
            CK(cudaMemcpy(a.data(), out_lib, a.size() * 2, cudaMemcpyDeviceToHost));
            double worst_w = 0;
            for (const auto &b : wides) {
                wide(0, b, out_ring);
                worst_w = std::max(worst_w, ring_err());
            }
            printf("W %3d: wide builds vs the 4-warp plan, worst rel err %.2e\n", W, worst_w);
            if (!(worst_w < 1e-2)) return 1;
            for (int rep = 0; rep < 2; ++rep) {
                time("4-warp builds, their plan", [&](int l) { lib(l, plan.occ7, plan.splits, plan.chunk, out_lib, plan.wave); });
                for (const auto &b : wides) time(std::string("wide, ") + b.name, [&](int l) { wide(l, b, out_ring); });
                // The ring as the library launches it, in the same run (at W 64 the 8-warp build
                // and the ring were compared only across sessions).
                time("library's ring (equal runs)", [&](int l) { lib_ring(l, out_ring); });
            }
        }
        for (int rep = 0; rep < 2 && !wide_only; ++rep) {
            time("library, its plan", [&](int l) { lib(l, plan.occ7, plan.splits, plan.chunk, out_lib, plan.wave); });
            time(plan.occ7 ? "library, its plan, plain build" : "library, its plan, 7-block build",
                 [&](int l) { lib(l, !plan.occ7, plan.splits, plan.chunk, out_lib, plan.wave); });
            time("library's ring (equal runs)", [&](int l) { lib_ring(l, out_ring); });
            if (brief) {
#ifdef RING_TIMELINE
                if (rep == 0) {  // the last of 96 chained ring launches, stamped
                    cudaGraph_t gr;
                    cudaGraphExec_t ex;
                    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                    for (int i = 0; i < LAUNCHES; ++i) lib_ring(i % LAYERS, out_ring);
                    CK(cudaStreamEndCapture(st, &gr));
                    CK(cudaGraphInstantiate(&ex, gr, 0));
                    median_graph_ms(ex, st, 3);
                    int on = 1;
                    CK(cudaMemcpyToSymbol(g_mark_on, &on, sizeof on));
                    CK(cudaGraphLaunch(ex, st));
                    CK(cudaStreamSynchronize(st));
                    on = 0;
                    CK(cudaMemcpyToSymbol(g_mark_on, &on, sizeof on));
                    const int blocks = LIB_BLOCKS_PER_SM * sms;
                    std::vector<unsigned long long> mk((size_t)blocks * 6);
                    CK(cudaMemcpyFromSymbol(mk.data(), g_marks, mk.size() * 8));
                    unsigned long long t0 = ~0ull;
                    for (int b = 0; b < blocks; ++b) t0 = std::min(t0, mk[(size_t)b * 6]);
                    const char *names[6] = {"start", "set-up done", "first copy issued", "first stage in", "consumers done", "producer done"};
                    printf("W %3d ctx %s%d  timeline of one ring launch (us from the first block's start; min / median / max over %d blocks; streaming at 4.45 TB/s takes %.2f)\n",
                           W, varied ? "<" : "", ctx, blocks, mb / 4.45);
                    for (int pnt : {0, 1, 2, 3, 5, 4}) {
                        std::vector<double> v;
                        for (int b = 0; b < blocks; ++b)
                            if (mk[(size_t)b * 6 + pnt] >= t0) v.push_back((mk[(size_t)b * 6 + pnt] - t0) / 1000.0);
                        std::sort(v.begin(), v.end());
                        if (!v.empty())
                            printf("W %3d   %-18s %7.2f %7.2f %7.2f  (%zu blocks)\n", W, names[pnt], v.front(), v[v.size() / 2], v.back(), v.size());
                    }
                    CK(cudaGraphExecDestroy(ex));
                    CK(cudaGraphDestroy(gr));
                }
#endif
                time("library's ring without its combine", [&](int l) { rng(l, LIB_BLOCKS_PER_SM, LIB_DEPTH, LIB_MIN_CHUNK, out_ring, false); });
                time("the ring's combine alone", [&](int) {
                    paged_decode_ring_combine_bf16_d128<<<LIB_BLOCKS_PER_SM * sms, 32 * HEADS, 0, st>>>(out_ring, ws_acc, ws_ml, ws_own, d_lens, d_cu, W, HEADS);
                });
                time("an empty kernel (the ring's grid)", [&](int) { empty_kernel<<<LIB_BLOCKS_PER_SM * sms, THREADS, 0, st>>>(); });
                time("library's qkv_rope_write alone", [&](int l) { rope_write(l); });
                time("qkv_rope_write + ring + combine", [&](int l) { rope_write(l); lib_ring(l, out_ring); });
                time("qkv_rope_write + SIMT plan", [&](int l) { rope_write(l); lib(l, plan.occ7, plan.splits, plan.chunk, out_lib, plan.wave); });
                time("ring with qkv_rope_write folded in + combine", [&](int l) { folded(l, out_ring); });
                continue;
            }
            for (const Shape &sh : shapes) {
                char name[64];
                snprintf(name, sizeof name, "ring, %d a SM, %d x 32 KB, runs >= %d stages", sh.per_sm, sh.depth, sh.min_chunk);
                time(name, [&](int l) { rng(l, sh.per_sm, sh.depth, sh.min_chunk, out_ring); });
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
        CK(cudaFree(ws_own));
        CK(cudaFree(qkv));
        CK(cudaFree(cs));
        CK(cudaFree(d_slots));
    }
    return 0;
}
