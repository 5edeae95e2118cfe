"""Probe (PyTorch + the driver API, on the device): what do stream-ordered allocation nodes cost
a captured decode graph? candle allocates every op's output with cuMemAllocAsync and frees it with
cuMemFreeAsync, so a captured looped decode step is a chain of ≈ 1000 kernels with an allocation
before each and frees between. This replays 1000 small kernels (a bf16 add on 16 × 2048) as a CUDA
graph: alone (PyTorch's graph pool: no memory nodes), with an allocation node before each kernel
and the previous buffer's free after it (candle's pattern), and with allocations only (frees at
the end). Prints µs per kernel.

    python3 tools/graph_nodes_probe.py [--kernels 1000] [--json out.json]
"""
import argparse, ctypes, json, os, sys
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import graph_us  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--kernels", type=int, default=1000)
p.add_argument("--json")
a = p.parse_args()
cu = ctypes.CDLL("libcuda.so.1")
x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)


def alloc(stream):
    ptr = ctypes.c_uint64()
    rc = cu.cuMemAllocAsync(ctypes.byref(ptr), ctypes.c_size_t(1 << 16), ctypes.c_void_p(stream))
    assert rc == 0, f"cuMemAllocAsync: {rc}"
    return ptr


def free(ptr, stream):
    rc = cu.cuMemFreeAsync(ptr, ctypes.c_void_p(stream))
    assert rc == 0, f"cuMemFreeAsync: {rc}"


def body(mode):
    s = torch.cuda.current_stream().cuda_stream
    y, prev, held = x, None, []
    for _ in range(a.kernels):
        if mode != "kernels only":
            ptr = alloc(s)
        y = torch.add(y, 1.0)
        if mode == "alloc before, free of the previous after":
            if prev is not None:
                free(prev, s)
            prev = ptr
        elif mode == "allocs only, frees at the end":
            held.append(ptr)
    for ptr in held + ([prev] if prev is not None else []):
        free(ptr, s)
    return y


out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kernels": a.kernels, "us_per_kernel": {}}
for mode in ["kernels only", "alloc before, free of the previous after", "allocs only, frees at the end", "kernels only"]:
    us = graph_us(lambda: body(mode)) / a.kernels
    out["us_per_kernel"].setdefault(mode, []).append(us)
    print(f"{mode:42s}: {us:6.3f} µs a kernel")
if a.json:
    json.dump(out, open(a.json, "w"), indent=1)
