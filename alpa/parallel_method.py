"""Alpa's module of the parallel methods, ``alpa.parallel_method``: every method, from
the module that defines it (``shard_method``: ``ParallelMethod`` and the one-mesh methods;
``pipeshard_method``: pipelines; ``create_state_parallel`` and ``follow_parallel``: methods
that follow another step's plan). Nothing in alpa imports this module; it imports them.
"""

from alpa.methods.create_state_parallel import CreateStateParallel
from alpa.methods.follow_parallel import FollowParallel
from alpa.methods.pipeshard_method import (
    LocalPipelineParallel,
    PipeshardParallel,
    get_3d_parallel_method,
)
from alpa.methods.shard_method import (
    DataParallel,
    ParallelMethod,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
)

__all__ = [
    "CreateStateParallel",
    "DataParallel",
    "FollowParallel",
    "LocalPipelineParallel",
    "ParallelMethod",
    "PipeshardParallel",
    "ShardParallel",
    "Zero2Parallel",
    "Zero3Parallel",
    "get_3d_parallel_method",
]
