"""aiter.dtypes (fake): the names the adapter may use."""

import torch

bf16 = torch.bfloat16
fp16 = torch.float16
fp32 = torch.float32
fp8 = torch.float8_e4m3fnuz  # gfx942's FP8 (gfx950: float8_e4m3fn)
i4x2 = torch.uint8  # two INT4 per byte
