"""Runs inside vLLM's worker process: loads a weight version that the producer put in shared memory.

vLLM mixes this class into its worker (`worker_extension_cls`), so the producer reaches it by name through
`AsyncLLM.collective_rpc("rlbus_load_shared", args=(segment, layout))`; only the segment's name and a small layout
cross the process boundary, never the bytes. The worker maps the segment, views each tensor in place
(`torch.frombuffer`, no copy), and hands the Hugging Face names to the worker's in-place `reload_weights`: the model's own `load_weights`
(which fuses q/k/v and gate/up into vLLM's layout) inside vLLM's layer-wise reload, which redoes the processing
that follows a load (repacking for the CPU kernels, say). The segment is the producer's: the worker keeps it mapped
from load to load (never unlinks it), and lets it go when the producer stages into a new one.

Kept free of rlbus imports: vLLM imports it by name in every worker, and it must not drag in the producer.
"""

from __future__ import annotations

import gc
from multiprocessing import shared_memory
from typing import Any

import torch

#: One tensor of a packed state dict: (name, dtype name as in torch, shape, byte offset in the segment).
TensorSlot = tuple[str, str, tuple[int, ...], int]


def _refresh_tied_heads(model: torch.nn.Module) -> None:
    """Redo the post-load processing of an output head tied to the input embedding.

    A tied head shares its weight with the embedding, so the reload processes only the embedding; but on CPU each of
    the two keeps its own packed copy for the matrix kernels (made by that processing), and the head's would go on
    computing logits with the old weights. Processing the head again repacks it from the (shared, now new) weight.
    Only the head: the embedding was processed by the reload (once more would cost a repack of the vocabulary for
    nothing); a head that got weights of its own was processed too. On GPU the processing does nothing."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    layers = [m for m in model.modules()
              if isinstance(getattr(m, "quant_method", None), UnquantizedEmbeddingMethod)
              and getattr(m, "weight", None) is not None]
    for head in layers:
        tied = any(other is not head and other.weight.data_ptr() == head.weight.data_ptr() for other in layers)
        if isinstance(head, ParallelLMHead) and tied:
            head.quant_method.process_weights_after_loading(head)


class WeightLoader:
    """The methods vLLM adds to its worker class (called on `self`, the worker)."""

    def rlbus_load_shared(self, segment: str, layout: list[TensorSlot]) -> int:
        """Load every tensor of `layout` from shared-memory `segment` into the model; returns how many loaded."""
        shm = _mapped(segment)
        named = []
        for name, dtype, shape, offset in layout:
            dt = getattr(torch, dtype)
            count = 1
            for d in shape:
                count *= d
            named.append((name, torch.frombuffer(shm.buf, dtype=dt, count=count, offset=offset).view(shape)))
        # The worker's in-place reload: the model's own load_weights between vLLM's layer-wise set-up and
        # finish, which redo what loading does after the checkpoint is read (on CPU, repacking the linear
        # layers for its kernels; a bare load_weights finds those parameters already repacked).
        worker: Any = self
        worker.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
        _refresh_tied_heads(worker.model_runner.model)
        num = len(named)
        del named
        return num


#: The producer's staging segment, mapped in this worker process from load to load: the producer writes each version
#: into the same segment, and a mapping kept open has its page tables filled (a fresh one faults on every page of
#: the state dict, on each load). Replaced when the producer makes a new segment (a bigger state dict).
_SEGMENTS: dict[str, shared_memory.SharedMemory] = {}


def _mapped(segment: str) -> shared_memory.SharedMemory:
    if segment not in _SEGMENTS:
        for old in _SEGMENTS.values():  # the producer unlinked it when it made the new one
            try:
                old.close()
            except BufferError:  # a view of the last load is still referenced from a cycle: collect it (rare)
                gc.collect()
                old.close()
        _SEGMENTS.clear()
        # Opening registers the segment with the resource tracker, which this spawned process shares with the
        # producer that made it (a second registration of one name is a no-op): the producer's unlink clears it.
        _SEGMENTS[segment] = shared_memory.SharedMemory(name=segment)
    return _SEGMENTS[segment]
