"""Expert parallelism over torch.distributed (NCCL on GPUs, gloo on CPU).

:class:`ExpertParallelMoE`: the NVFP4 MoE block with its routed experts split over the ranks (all-to-all
dispatch and combine, exact and CUDA-graph capacity modes); :func:`load_expert_parallel_moe`: each rank reads
only its experts from a ModelOpt checkpoint; :class:`TokenSplitMoE`: the model's MoE block under expert
parallelism (``V4Model(..., ep_group=...)``, ``generate --ep``); :func:`init_from_env`: the process group under
``torchrun``.
"""
from .comm import backend_for, check_same_across_ranks, init_from_env, shutdown  # noqa: F401
from .ep_block import TokenSplitMoE  # noqa: F401
from .ep_moe import ExpertParallelMoE, expert_range, slice_experts  # noqa: F401
from .loading import load_expert_parallel_moe  # noqa: F401
