"""Runs inside vLLM's worker process: loads a weight version that the producer put in shared memory.

vLLM mixes this class into its worker (`worker_extension_cls`), so the producer reaches it by name through
`AsyncLLM.collective_rpc("rlbus_load_shared", args=(segment, layout))`; only the segment's name and a small layout
cross the process boundary, never the bytes. The worker maps the segment and views each tensor in place
(`torch.frombuffer`, no copy). Two ways in from there:

- **Direct (CPU, one worker, unquantized).** On CPU vLLM keeps each linear layer only in the packed form its matrix
  kernels read (the weight itself is dropped after packing), so a load is a repack. The direct path repacks each
  layer straight from the segment: the producer stages sibling projections next to each other (q, k, v; gate, up),
  so a fused layer's weight is one view of the segment, and the layer's own post-load processing packs it from
  there; biases, norms and the embedding are copied in place; a tied output head is repacked from the new
  embedding. Every name must map onto a module of a kind this path knows, or nothing is touched and the reload
  below runs instead.
- **Reload (everything else, GPU included).** The worker's in-place `reload_weights`: the model's own
  `load_weights` (which fuses q/k/v and gate/up into vLLM's layout) inside vLLM's layer-wise reload, which redoes
  the processing that follows a load.

The segment is the producer's: the worker keeps it mapped from load to load (never unlinks it), and lets it go when
the producer stages into a new one. Nothing the model computes with may alias it: the producer writes the next
version into it while generation goes on.

Kept free of rlbus imports: vLLM imports it by name in every worker, and it must not drag in the producer.
"""

from __future__ import annotations

import gc
import math
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

    def rlbus_load_shared(self, segment: str, layout: list[TensorSlot]) -> tuple[int, str]:
        """Load every tensor of `layout` from shared-memory `segment` into the model; returns how many, and which
        way they went in ("direct" or "reload")."""
        shm = _mapped(segment)
        worker: Any = self
        model = worker.model_runner.model
        plan = _direct_plan(model, shm, layout)
        if plan is not None:
            plan()
            path = "direct"
        else:
            # The worker's in-place reload: the model's own load_weights between vLLM's layer-wise set-up and
            # finish, which redo what loading does after the checkpoint is read (on CPU, repacking the linear
            # layers for its kernels; a bare load_weights finds those parameters already repacked).
            named = [(name, _view(shm, dtype, shape, offset)) for name, dtype, shape, offset in layout]
            worker.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)
            _refresh_tied_heads(model)
            del named
            path = "reload"
        del plan
        return len(layout), path


def _view(shm: shared_memory.SharedMemory, dtype: str, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """The tensor at `offset` of the segment, in place."""
    return torch.frombuffer(shm.buf, dtype=getattr(torch, dtype), count=math.prod(shape), offset=offset).view(shape)


def _fused(shm: shared_memory.SharedMemory, parts: list[tuple[str, tuple[int, ...], int]]) -> torch.Tensor:
    """Tensors of the segment (dtype, shape, offset) stacked along dim 0, as vLLM fuses sibling projections: one view
    of the segment where the producer staged them back to back (the usual case), else a copy."""
    dtype, shape, offset = parts[0]
    end = offset
    for d, sh, off in parts:
        if off != end or d != dtype or tuple(sh[1:]) != tuple(shape[1:]):
            return torch.cat([_view(shm, *p) for p in parts])
        end += math.prod(sh) * getattr(torch, d).itemsize
    return _view(shm, dtype, (sum(sh[0] for _, sh, _ in parts), *shape[1:]), offset)


def _direct_plan(model: torch.nn.Module, shm: shared_memory.SharedMemory, layout: list[TensorSlot]) -> Any:
    """A function that loads the tensors of `layout` straight into `model` (see the module's docstring), or None
    when some name or module is not of a kind the direct path knows (the caller reloads instead). Nothing is changed
    until the returned function runs."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or get_tensor_model_parallel_world_size() != 1:
        return None
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    shard_of = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    # module path -> param name -> [(shard index, (dtype, shape, offset))]
    targets: dict[str, dict[str, list[tuple[int, tuple[str, tuple[int, ...], int]]]]] = {}
    for name, dtype, shape, offset in layout:
        module_path, _, param = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if tied and module_path == "lm_head":
            continue  # the head is the embedding (vLLM's load_weights skips it too)
        index = 0
        if leaf in shard_of:
            fused_leaf, index = shard_of[leaf]
            module_path = f"{parent}.{fused_leaf}" if parent else fused_leaf
        targets.setdefault(module_path, {}).setdefault(param, []).append((index, (dtype, tuple(shape), offset)))
    steps = []
    heads: list[torch.nn.Module] = []
    for module_path, params in targets.items():
        try:
            module = model.get_submodule(module_path)
        except AttributeError:
            return None
        method = getattr(module, "quant_method", None)
        for param, shards in params.items():
            shards.sort(key=lambda s: s[0])
            expected = len(packed.get(module_path.rpartition(".")[2], [None]))
            if [s[0] for s in shards] != list(range(expected)):
                return None  # a fused layer given only some of its projections: let vLLM's loader judge
            parts = [slot for _, slot in shards]
            if isinstance(module, LinearBase):
                if type(method) is not UnquantizedLinearMethod or not hasattr(module, "cpu_linear"):
                    return None
                if param == "weight":
                    weight = _fused(shm, parts)
                    if tuple(weight.shape) != (module.output_size_per_partition, module.input_size_per_partition):
                        return None
                    steps.append(lambda m=module, w=weight: _repack_linear(m, w))
                    continue
            elif isinstance(module, VocabParallelEmbedding):
                if type(method) is not UnquantizedEmbeddingMethod or param != "weight" or len(parts) != 1:
                    return None
                target = module.weight
                view = _view(shm, *parts[0])
                if view.dim() != 2 or view.shape[1] != target.shape[1] or view.shape[0] > target.shape[0]:
                    return None
                steps.append(lambda t=target, v=view: t.data[: v.shape[0]].copy_(v))
                if isinstance(module, ParallelLMHead):
                    heads.append(module)
                continue
            elif method is not None:
                return None
            target = getattr(module, param, None)
            if not isinstance(target, torch.Tensor):
                return None
            value = _fused(shm, parts)
            if tuple(value.shape) != tuple(target.shape):
                return None
            steps.append(lambda t=target, v=value: t.data.copy_(v))
    if tied:
        head = getattr(model, "lm_head", None)
        if isinstance(head, ParallelLMHead) and type(head.quant_method) is UnquantizedEmbeddingMethod:
            heads.append(head)

    def run() -> None:
        for step in steps:
            step()
        # The heads' packed copies, from their (new) weights; the input embedding is only looked up, never
        # multiplied, so its own packed copy is left alone.
        for head in {id(h): h for h in heads}.values():
            head.quant_method.process_weights_after_loading(head)

    return run


def _repack_linear(layer: torch.nn.Module, weight: torch.Tensor) -> None:
    """The layer's own post-load processing, from `weight` (a view of the segment): on CPU it packs the weight for
    its kernels and drops it. Whatever the layer keeps must not be the segment (the next version is staged there),
    so a weight it keeps is copied."""
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.quant_method.process_weights_after_loading(layer)
    if layer.weight.numel() and layer.weight.data_ptr() == weight.data_ptr():
        layer.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)


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
