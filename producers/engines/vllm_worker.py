"""Runs inside vLLM's worker process: loads a weight version that the producer put in shared memory.

vLLM mixes this class into its worker (`worker_extension_cls`), so the producer reaches it by name through
`AsyncLLM.collective_rpc("rlbus_load_shared", args=(segment, layout))`; only the segment's name and a small layout
cross the process boundary, never the bytes. The worker maps the segment, views each tensor in place
(`torch.frombuffer`, no copy), and hands the Hugging Face names to the worker's in-place `reload_weights`: the model's own `load_weights`
(which fuses q/k/v and gate/up into vLLM's layout) inside vLLM's layer-wise reload, which redoes the processing
that follows a load (repacking for the CPU kernels, say). The segment is the producer's: the worker
neither keeps nor unlinks it.

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
    """Redo the post-load processing of embedding-shaped layers that received no weights of their own.

    A tied output head shares its weight with the input embedding, so the reload processes only the embedding; but
    on CPU each of the two keeps its own packed copy for the matrix kernels (made by that processing), and the head's
    would go on computing logits with the old weights. Processing every embedding-method layer again repacks it
    from the (shared, now new) weight; on GPU that processing does nothing."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod) and getattr(module, "weight", None) is not None:
            method.process_weights_after_loading(module)


class WeightLoader:
    """The methods vLLM adds to its worker class (called on `self`, the worker)."""

    def rlbus_load_shared(self, segment: str, layout: list[TensorSlot]) -> int:
        """Load every tensor of `layout` from shared-memory `segment` into the model; returns how many loaded."""
        # Opening registers the segment with the resource tracker, which this spawned process shares with the
        # producer that made it (a second registration of one name is a no-op): the producer's unlink clears it.
        shm = shared_memory.SharedMemory(name=segment)
        try:
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
        finally:
            try:
                shm.close()
            except BufferError:  # a view is still referenced from a cycle: collect it, then close (slow: rare)
                gc.collect()
                shm.close()
