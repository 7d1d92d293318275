"""NVFP4 GEMM kernel family: Triton tensor-core and CUDA-core kernels, Gluon mma.sync / wgmma
decode kernels, dense split-K, and their shared JIT helpers. Dispatch lives in ``megamoe.ops.gemm``."""
