"""flyquant: FlyDSL kernels for MX-format MoE on AMD Instinct GPUs."""
