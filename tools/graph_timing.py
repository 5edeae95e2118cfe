"""What the PyTorch probes share (`splitk_probe.py`, `l2_probe.py`): a projection whole or as k
slices with f32 partial products, and the time of a body replayed as a CUDA graph."""
import torch
import torch.nn.functional as F


def proj(x, w, s):
    """x · wᵀ, or with s > 1 its s partial products over k slices ([s, rows, n], f32; no copies:
    strided-batched cuBLAS)."""
    if s == 1:
        return F.linear(x, w)
    n, k = w.shape
    xs = x.view(x.shape[0], s, k // s).transpose(0, 1)  # [s, rows, k/s]
    ws = w.view(n, s, k // s).permute(1, 2, 0)  # [s, k/s, n]
    return torch.bmm(xs, ws, out_dtype=torch.float32)


def graph_us(body, reps=20):
    """µs per replay of `body` captured as a CUDA graph (warmed up on a side stream first)."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        body()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps * 1000.0
