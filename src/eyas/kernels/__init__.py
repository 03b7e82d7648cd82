"""kernels/: Triton / CUDA kernels and torch.compile fusions, each beside its torch fallback."""
