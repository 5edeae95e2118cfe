//! Compiles the CUDA kernels in `src/ops/kernels/*.cu` to PTX when the `cuda` feature is on.
//! Without the feature this does nothing (CPU builds and CI need no nvcc).

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    // Set when the PTX targets sm_90a, whose kernels may use Hopper's warpgroup MMA.
    println!("cargo::rustc-check-cfg=cfg(ponder_wgmma)");
    // Set when the PTX targets sm_90 or later, whose kernels may use bulk copies and mbarriers.
    println!("cargo::rustc-check-cfg=cfg(ponder_bulk_copy)");
    #[cfg(feature = "cuda")]
    cuda::build();
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::path::PathBuf;

    pub fn build() {
        println!("cargo::rerun-if-changed=src/ops/kernels");
        println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
        let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
        // sm_90 (H100/H200) unless CUDA_COMPUTE_CAP says otherwise; no GPU is needed here.
        let cap = std::env::var("CUDA_COMPUTE_CAP").ok().and_then(|s| s.trim().parse::<usize>().ok()).unwrap_or(90);
        // cudaforge builds sm_90 as sm_90a, the target with `wgmma` (the MoE kernels use it there).
        if cap == 90 {
            println!("cargo::rustc-cfg=ponder_wgmma");
        }
        if cap >= 90 {
            println!("cargo::rustc-cfg=ponder_bulk_copy");
        }
        let ptx = cudaforge::KernelBuilder::new()
            .source_dir("src/ops/kernels")
            .compute_cap(cap)
            .out_dir(&out_dir)
            .arg("--expt-relaxed-constexpr")
            .arg("-std=c++17")
            .arg("-O3")
            .build_ptx()
            .unwrap_or_else(|e| panic!("compiling CUDA kernels: {e}"));
        ptx.write(out_dir.join("ponder_kernels.rs")).unwrap_or_else(|e| panic!("writing PTX bindings: {e}"));
    }
}
