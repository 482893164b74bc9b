"""A calibrated group's rank: the torch.distributed process group this worker joins, and when the library uses it.

    Hello.group (rank, world, host:port, secret, timeout, backend)
      join(group)         rank 0 hosts the rendezvous, a TCPStore on host:port (picked free by the supervisor);
                          the others connect to it; every key lives under the run's secret (PrefixStore), so a
                          process that connects without it cannot join the group or disturb its keys;
                          init_process_group(gloo | nccl, timeout): no collective waits past `timeout`
      collectives()       around one layer's calibration only: llm-compressor's own distributed code runs there
                          (GPTQ's Hessians reduced to each module's owner by greedy bin packing, solved there and
                          broadcast; observers' activation statistics all-reduced; AWQ's sums all-reduced on GPUs).
                          Everywhere else the library sees one process (compressed-tensors' single-threaded switch):
                          the export plan, config.json, the loader check and the non-layer part run on rank 0 alone
                          and must not wait for ranks that are not asked
      leave()             destroy the process group (on Stop)

One change to the library's behaviour, inside collectives() only: `broadcast_qparams_and_cleanup` skips modules that
execute on the CPU (its CPU offload shares one copy of the weights between ranks through shared memory). Each of our
ranks holds its own copy of the layer, so every module's result is broadcast from its owner, whatever the device;
without it a CPU rank would propagate the layer with the other ranks' modules unquantized.

Owns the process group's life in this worker; it never decides which samples a rank holds (child.samples) or
what is written (the Exporter: rank 0 writes the shard, every rank its boundary).
"""
from __future__ import annotations

import contextlib
import datetime
import functools

from shared.messages import Group

_group: Group | None = None


def join(group: Group, startup_timeout: float) -> None:
    """Meet the other ranks and initialise the default process group (blocks until all `world` ranks joined, at
    most `startup_timeout` seconds)."""
    global _group
    import torch
    import torch.distributed as dist
    from compressed_tensors.distributed import utils

    utils._force_single_threaded = True  # the library sees one process until collectives()
    store = dist.TCPStore(group.host, group.port, world_size=group.world, is_master=group.rank == 0,
                          timeout=datetime.timedelta(seconds=startup_timeout), wait_for_workers=False)
    kwargs = {}
    if group.backend == "nccl":
        kwargs["device_id"] = torch.device("cuda:0")  # each rank sees its own GPU only
    dist.init_process_group(group.backend, store=dist.PrefixStore(f"supervisor/{group.secret}/", store),
                            rank=group.rank, world_size=group.world,
                            timeout=datetime.timedelta(seconds=group.timeout), **kwargs)
    _group = group


def rank() -> int:
    return _group.rank if _group is not None else 0


def world() -> int:
    return _group.world if _group is not None else 1


@contextlib.contextmanager
def collectives():
    """The library's distributed code on, for one layer's calibration (a no-op outside a group)."""
    if _group is None:
        yield
        return
    from compressed_tensors.distributed import utils
    from compressed_tensors.utils import patch_attr
    from llmcompressor.modifiers.gptq import base as gptq
    from llmcompressor.modifiers.quantization.quantization import base as quantization
    from llmcompressor.utils.dist import broadcast_qparams_and_cleanup

    every_module = functools.partial(broadcast_qparams_and_cleanup, skip_cpu=False)
    with patch_attr(utils, "_force_single_threaded", False), \
            patch_attr(gptq, "broadcast_qparams_and_cleanup", every_module), \
            patch_attr(quantization, "broadcast_qparams_and_cleanup", every_module):
        yield


def leave() -> None:
    global _group
    if _group is None:
        return
    import torch.distributed as dist

    _group = None
    if dist.is_initialized():
        dist.destroy_process_group()
