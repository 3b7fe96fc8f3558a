"""Process groups (TP, DCP) and their collectives."""
from vllm.distributed.parallel_state import (GroupCoordinator, destroy_distributed_environment,
                                             destroy_model_parallel, get_dcp_group,
                                             get_tp_group, get_world_group,
                                             init_distributed_environment,
                                             initialize_model_parallel)

__all__ = ["GroupCoordinator", "destroy_distributed_environment", "destroy_model_parallel",
           "get_dcp_group", "get_tp_group", "get_world_group", "init_distributed_environment",
           "initialize_model_parallel"]
