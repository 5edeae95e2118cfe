// Probe (nvcc, on the device): what do the memory nodes of a captured decode graph cost? candle
// allocates every op's output through the stream (cudaMallocAsync) and frees dropped tensors the
// same way, so a captured decode step is a chain of alloc / kernel / free nodes, not of kernels
// alone (session 17 found the driver will not rewrite such a graph for PDL). This times one chain
// of N dependent kernels captured three ways — buffers preallocated (kernels only), each kernel's
// output allocated before it and its input freed after it (as candle does), and the same with
// the frees left to the end — for kernels that do nothing and for kernels that stream a small
// buffer (≈ the decode step's elementwise kernels).
//
//     nvcc -O3 -std=c++17 -arch=sm_90a -Itools tools/graph_nodes_probe.cu -o /tmp/gn && /tmp/gn [N]
#include "probe_ptx.cuh"

// out = in * 1.0001 + 1 over n floats (n = 0: an empty kernel).
__global__ void step(float *out, const float *in, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = in[i] * 1.0001f + 1.f;
}

enum class Mem { Prealloc, AllocFree, AllocFreeAtEnd };

int main(int argc, char **argv) {
    const int N = argc > 1 ? atoi(argv[1]) : 1000;
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    for (int n : {0, 64 * 2048, 256 * 2048}) {
        const size_t bytes = (size_t)std::max(n, 1) * 4;
        float *a, *b;
        CK(cudaMalloc(&a, bytes));
        CK(cudaMalloc(&b, bytes));
        CK(cudaMemset(a, 0, bytes));
        const int grid = n == 0 ? 1 : std::min(4 * sms, (n + 255) / 256);
        for (Mem mem : {Mem::Prealloc, Mem::AllocFree, Mem::AllocFreeAtEnd, Mem::Prealloc, Mem::AllocFree}) {
            cudaGraph_t g;
            cudaGraphExec_t ex;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            float *in = a;
            std::vector<float *> pending;
            for (int i = 0; i < N; ++i) {
                float *out;
                if (mem == Mem::Prealloc) {
                    out = in == a ? b : a;
                } else {
                    CK(cudaMallocAsync(&out, bytes, st));
                }
                step<<<grid, 256, 0, st>>>(out, in, n);
                if (mem != Mem::Prealloc && in != a) {
                    if (mem == Mem::AllocFree)
                        CK(cudaFreeAsync(in, st));
                    else
                        pending.push_back(in);
                }
                in = out;
            }
            if (mem != Mem::Prealloc && in != a) pending.push_back(in);
            for (float *p : pending) CK(cudaFreeAsync(p, st));
            CK(cudaStreamEndCapture(st, &g));
            size_t nodes = 0;
            CK(cudaGraphGetNodes(g, nullptr, &nodes));
            CK(cudaGraphInstantiate(&ex, g, 0));
            CK(cudaGraphUpload(ex, st));
            const float ms = median_graph_ms(ex, st, 15);
            const char *name = mem == Mem::Prealloc ? "kernels only (preallocated)" : mem == Mem::AllocFree ? "alloc + kernel + free (as candle)" : "alloc + kernel, frees at the end";
            printf("%d kernels of %8d floats, %-34s %6zu nodes: %8.3f ms  %6.2f us a kernel\n", N, n, name, nodes, ms, ms * 1000.0 / N);
            CK(cudaGraphExecDestroy(ex));
            CK(cudaGraphDestroy(g));
        }
        CK(cudaFree(a));
        CK(cudaFree(b));
    }
    return 0;
}
