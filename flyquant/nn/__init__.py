"""torch.nn modules on flyquant: MoE experts running fq.fused_moe (experts.py), and the swaps into
transformers' models (models.py: GPT-OSS with its checkpoint's MXFP4 tensors; any model of its
experts interface: patch_moe)."""

from .experts import MoEExperts
from .models import from_gpt_oss_experts, from_transformers_experts, patch_gpt_oss, patch_moe

__all__ = ["MoEExperts", "from_gpt_oss_experts", "from_transformers_experts", "patch_gpt_oss", "patch_moe"]
