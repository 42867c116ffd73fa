"""z3kit: small, composable primitives for ZeRO-3 style fully sharded data
parallel training on PyTorch. Each lives in a module of its own and is
usable without ``z3kit_recipes``; see ``z3kit_recipes.zero3`` for the stock
runtime that composes them."""

from z3kit.collectives import CollectiveKind, CollectiveLog, Pending, all_gather, all_reduce, broadcast, reduce_scatter
from z3kit.device import DeviceInfo, accelerator_type, backend_for, resolve_device
from z3kit.flat_bucket import BucketFlush, FlatBucket, ReduceMode
from z3kit.grad_partition import GradPartitionBuffer
from z3kit.hook_context import at_backward_end, in_backward
from z3kit.hooks import HookActions, ModuleHooks
from z3kit.host_work import HostWork
from z3kit.leaf import LeafModuleHook
from z3kit.links import LinkClass, NodeMap
from z3kit.nested import iter_tensors, map_tensors
from z3kit.prefetch import PrefetchLimiter
from z3kit.release import ImmediateReleasePolicy, ReleasePolicy, StockReleasePolicy
from z3kit.shard import GatherHandle, ParamShard, ParamStatus, gather_shards, partition_of, shard_numel_for
from z3kit.stream_check import RecordingStreamPair, StreamOrderChecker, StreamOrderError
from z3kit.streams import CommTicket, StreamPair, StreamPairLike, SyncStreamPair, stream_pair_for
from z3kit.trace import TraceFetch, TraceRecorder, TraceState

__all__ = [
    "BucketFlush",
    "CollectiveKind",
    "CollectiveLog",
    "CommTicket",
    "DeviceInfo",
    "FlatBucket",
    "GatherHandle",
    "GradPartitionBuffer",
    "HookActions",
    "HostWork",
    "ImmediateReleasePolicy",
    "LeafModuleHook",
    "LinkClass",
    "ModuleHooks",
    "NodeMap",
    "ParamShard",
    "ParamStatus",
    "Pending",
    "PrefetchLimiter",
    "RecordingStreamPair",
    "ReduceMode",
    "ReleasePolicy",
    "StockReleasePolicy",
    "StreamOrderChecker",
    "StreamOrderError",
    "StreamPair",
    "StreamPairLike",
    "SyncStreamPair",
    "TraceFetch",
    "TraceRecorder",
    "TraceState",
    "accelerator_type",
    "at_backward_end",
    "all_gather",
    "all_reduce",
    "backend_for",
    "broadcast",
    "gather_shards",
    "in_backward",
    "iter_tensors",
    "map_tensors",
    "partition_of",
    "reduce_scatter",
    "resolve_device",
    "shard_numel_for",
    "stream_pair_for",
]
