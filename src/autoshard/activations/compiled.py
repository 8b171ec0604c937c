"""What compiling a block saves in activation memory: the bytes its eager forward keeps for backward, minus those
the compiled forward keeps. The simulated step runs eager (dynamo on fake tensors beside a fake process group is neither cheap nor what FSDP2's
hooks see), so a compiled block's activations are counted from its graph: AOTAutograd's joint forward-backward
graph, cut by inductor's min-cut partitioner, against what autograd's saved-tensor hooks see in eager. Both run on
fake tensors of the block's real input shapes: nothing is compiled and no memory is used.

Measured on one H200 (a 0.9B Llama, 4 x 2048 tokens, bf16-mixed): compiling each of its 16 decoder layers lowered
the peak by 3.38 GiB (27.09 -> 23.71 GiB). Counted here: eager keeps 705.6 MiB per layer, the min-cut graph
489.6 MiB; 16 x 216 MiB = 3.375 GiB. A checkpointed block keeps only its input either way: it saves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autoshard.privates import in_torch


@dataclass(frozen=True)
class BlockSaving:
    """Bytes one forward of a block keeps for its backward, eager and compiled. Its parameters are left out (FSDP2
    frees and gathers them either way); its input counts where it is kept (the compiled graph keeps a bf16 input
    where eager keeps the float32 copy a norm made of it)."""

    eager: int
    compiled: int

    @property
    def saved(self) -> int:
        return max(self.eager - self.compiled, 0)


def block_saving(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype) -> BlockSaving:
    """``block``'s saved bytes for one forward on ``args``/``kwargs``, eager and compiled. Run inside the fake mode the
    inputs belong to; ``block`` may live on meta (only its parameters' shapes are read)."""
    from torch.func import functional_call

    names = [name for name, _ in block.named_parameters()]
    params = [
        torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, requires_grad=p.requires_grad) for _, p in block.named_parameters()
    ]
    leaves, spec = in_torch.tree_flatten((args, kwargs))
    tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def forward(*flat: torch.Tensor) -> torch.Tensor:
        values = list(leaves)
        for i, tensor in zip(tensors, flat[len(params) :]):
            values[i] = tensor
        call_args, call_kwargs = in_torch.tree_unflatten(values, spec)
        out = functional_call(block, dict(zip(names, flat[: len(params)])), call_args, call_kwargs)
        first, _ = in_torch.tree_flatten(out)
        return next(t for t in first if isinstance(t, torch.Tensor))

    inputs = [*params, *(leaves[i] for i in tensors)]
    weights = {id(t.untyped_storage()) for t in params}  # a storage keeps one Python object: a weight's views are it
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if id(storage) not in weights:
            kept[id(storage)] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward(*inputs)
    compiled: list[int] = []

    def forward_compiler(graph: torch.fx.GraphModule, _: Any) -> torch.fx.GraphModule:
        (outputs,) = (node.args[0] for node in graph.graph.nodes if node.op == "output")
        primals = [node for node in graph.graph.nodes if node.op == "placeholder"][: len(params)]
        given = {id(node.meta["val"].untyped_storage()) for node in primals if _is_tensor(node)}
        saved = {id(s): s.nbytes() for s in (node.meta["val"].untyped_storage() for node in outputs[1:] if _is_tensor(node))}
        compiled.append(sum(nbytes for key, nbytes in saved.items() if key not in given))
        return graph

    traced = in_torch.aot_function(
        forward, fw_compiler=forward_compiler, bw_compiler=lambda graph, _: graph, partition_fn=in_torch.min_cut_rematerialization_partition
    )
    traced(*inputs)
    return BlockSaving(eager=sum(kept.values()), compiled=compiled[0] if compiled else sum(kept.values()))


def _is_tensor(node: object) -> bool:
    return isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)
