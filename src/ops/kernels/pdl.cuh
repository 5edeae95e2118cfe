// Programmatic dependent launch (Hopper and later).
//
// A CUDA graph of the decode step may let one of our kernels start while the kernel before it
// is still finishing (`engine::graphs` turns the edge into a programmatic one, only into kernels
// that call `pdl_begin` first). So every such kernel calls it before touching global memory:
// `launch_dependents` lets the next kernel's blocks be scheduled once all of ours are, and
// `wait` returns when the kernel before has completed and its writes are visible. Launched the
// ordinary way, both instructions do nothing.
#pragma once

__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
