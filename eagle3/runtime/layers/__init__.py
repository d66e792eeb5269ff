"""Model building blocks over the kernel backend: Linear (any weight format), RMSNorm, RoPE,
MoE, MLA and paged MHA attention."""
