"""Tensor parallel from the model's own plan: transformers' ``base_model_tp_plan`` / ``_tp_plan``, or a plain
``_tp_plan`` dict, checked before any process trains, then applied with torch's ``parallelize_module``; every parameter
the plan leaves alone becomes a ``Replicate()`` DTensor, which ``fully_shard`` over the data-parallel ranks needs.

Only the Megatron layout (no sequence parallelism) is built: between a rowwise layer and the next colwise one every
activation is whole on every tensor-parallel rank, so a parameter the plan leaves alone sees the same input and the
same output gradient on each of them, and its gradient is equal across them without any collective.
"""

from __future__ import annotations

import difflib
import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from torch import nn

from autoshard.errors import IncompatibleBackendError, IntentError
from autoshard.mesh import divisors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class StyleKind(str, Enum):
    """What a style does to a module's parameters; the plan's checks and the layout branch on this."""

    COLWISE = "colwise"  # nn.Linear split by output features: weight and bias Shard(0)
    ROWWISE = "rowwise"  # nn.Linear split by input features: weight Shard(1), bias whole (added once, after the sum)
    EMBEDDING_ROWWISE = "embedding_rowwise"  # nn.Embedding split by vocabulary rows: weight Shard(0)
    EMBEDDING_COLWISE = "embedding_colwise"  # nn.Embedding split by hidden columns: weight Shard(1)
    REPLICATE = "replicate"  # whole on every rank, gradients equal across ranks by construction
    REPLICATE_SUM_GRADS = "replicate_sum_grads"  # whole on every rank, each rank's gradient a partial sum (see below)


@dataclass(frozen=True)
class Style:
    """One plan style autoshard applies: transformers' name, what it does, and the layout between modules."""

    name: str
    kind: StyleKind
    meaning: str
    gather_output: bool = False  # colwise: the output all-gathered (whole) instead of this rank's slice of features
    split_input: bool = False  # rowwise: the input arrives whole and each rank takes its slice (no collective)

    @property
    def module_type(self) -> type[nn.Module] | None:
        if self.kind in (StyleKind.COLWISE, StyleKind.ROWWISE):
            return nn.Linear
        if self.kind in (StyleKind.EMBEDDING_ROWWISE, StyleKind.EMBEDDING_COLWISE):
            return nn.Embedding
        return None

    def split_dim(self, param: str) -> int | None:
        """The dimension of parameter ``param`` (``weight``, ``bias``) this style splits across ranks; None: whole."""
        if self.kind is StyleKind.COLWISE:
            return 0
        weight_dims = {StyleKind.ROWWISE: 1, StyleKind.EMBEDDING_ROWWISE: 0, StyleKind.EMBEDDING_COLWISE: 1}
        return weight_dims.get(self.kind) if param == "weight" else None

    @property
    def collective(self) -> str:
        """The collective this style adds per forward (the backward mirrors it), for explain's traffic rows."""
        if self.kind is StyleKind.COLWISE:
            return "all-gather of the output" if self.gather_output else "none in forward (all-reduce of the input gradient in backward)"
        if self.kind in (StyleKind.ROWWISE, StyleKind.EMBEDDING_ROWWISE):
            return "all-reduce of the output"
        if self.kind is StyleKind.EMBEDDING_COLWISE:
            return "all-gather of the output"
        if self.kind is StyleKind.REPLICATE_SUM_GRADS:
            return "all-reduce of the gradient"
        return "none"


STYLES: dict[str, Style] = {
    s.name: s
    for s in (
        Style("colwise", StyleKind.COLWISE, "output features split, output kept split"),
        Style("colwise_rep", StyleKind.COLWISE, "output features split, output all-gathered", gather_output=True),
        Style("colwise_gather_output", StyleKind.COLWISE, "output features split, output all-gathered", gather_output=True),
        Style("rowwise", StyleKind.ROWWISE, "input features split, outputs summed"),
        Style("rowwise_rep", StyleKind.ROWWISE, "input features split from a whole input, outputs summed", split_input=True),
        Style("rowwise_split_input", StyleKind.ROWWISE, "input features split from a whole input, outputs summed", split_input=True),
        Style("embedding_rowwise", StyleKind.EMBEDDING_ROWWISE, "vocabulary rows split, lookups summed"),
        Style("embedding_colwise", StyleKind.EMBEDDING_COLWISE, "hidden columns split, lookups all-gathered"),
        Style("replicate", StyleKind.REPLICATE, "whole on every rank"),
        Style(
            "replicated_with_grad_allreduce",
            StyleKind.REPLICATE_SUM_GRADS,
            "whole on every rank; sees only this rank's heads, so gradients are summed across ranks",
        ),
    )
}

# Styles transformers defines that autoshard does not apply, and why; mixture-of-experts ones are reported first.
MOE_STYLES: dict[str, str] = {
    "moe_tp_experts": "mixture-of-experts experts split across tensor-parallel ranks",
    "grouped_gemm": "mixture-of-experts grouped matmul of expert parallelism",
    "ep_dispatch_experts": "mixture-of-experts token dispatch of expert parallelism",
    "ep_router": "mixture-of-experts router of expert parallelism",
}
OTHER_STYLES: dict[str, str] = {
    "packed_colwise": "fused weights packed along the output dimension (strided shards)",
    "packed_rowwise": "fused weights packed along the input dimension (strided shards)",
    "unit_colwise": "whole heads replicated when there are fewer heads than ranks",
    "unit_rowwise": "whole heads replicated when there are fewer heads than ranks",
    "sequence_parallel": "activations split along the sequence between layers",
    "mla_kv_a_proj": "DeepSeek's multi-head latent attention projection",
    "all_reduce": "a module whose output is a partial sum",
    "local_params": "a parameter-level rule run on local tensors",
}
# Leaf names of attention projections whose colwise split must keep whole heads on each rank.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "query", "key", "value", "Wqkv", "c_attn")
HEAD_COUNTS = (("num_attention_heads", "num_heads", "n_heads", "n_head"), ("num_key_value_heads", "num_kv_heads", "n_kv_heads"))
_APPLIED = "_autoshard_tp_plan_applied"
_MOST_NAMED = 3
_MOST_LISTED = 8
# The kinds that split a module's weight across tensor-parallel ranks: a plan with none of them splits nothing.
SPLITTING = (StyleKind.COLWISE, StyleKind.ROWWISE, StyleKind.EMBEDDING_ROWWISE, StyleKind.EMBEDDING_COLWISE)


@dataclass(frozen=True)
class TPEntry:
    """One concrete rule: module (or parameter) ``path`` relative to the module the plan was found on, its style
    name, the plan key it came from, and why it is there (the plan, or a tied weight autoshard kept whole)."""

    path: str
    style: str
    key: str
    why: str = "the model's plan"
    is_param: bool = False

    @property
    def spec(self) -> Style | None:
        return STYLES.get(self.style)


@dataclass(frozen=True)
class TPCollective:
    """One collective the layout adds per training step, on the tensor-parallel ranks: ``features`` elements per
    token of the micro-batch (``phase`` forward or backward), or per step (``phase`` "gradients": parameters)."""

    path: str
    collective: str  # "all-reduce" | "all-gather"
    phase: str  # "forward" | "backward" | "gradients"
    features: int

    @property
    def per_token(self) -> bool:
        return self.phase != "gradients"

    def sent(self, elements: int, elsize: int, tp: int) -> int:
        """Bytes one rank sends for ``elements`` elements, ring algorithms: an all-reduce sends 2 (g - 1) / g of the
        data, an all-gather (g - 1) / g of the gathered output."""
        share = 2 * (tp - 1) if self.collective == "all-reduce" else tp - 1
        return elements * elsize * share // tp


@dataclass
class TPPlan:
    """The tensor-parallel layout of one module: concrete entries in module order, and where the plans came from.

    ``roots``: the modules that carry a plan; the parameters inside them no entry splits become ``Replicate()``
    DTensors. ``unmatched``: plan keys that name no module (transformers' generic plans name modules some
    configurations lack); only those of a plain ``_tp_plan`` dict (``unmatched_own``) are warned about.
    """

    entries: tuple[TPEntry, ...]
    roots: tuple[str, ...]
    sources: tuple[str, ...]
    unmatched: tuple[str, ...] = ()
    notes: list[str] = field(default_factory=list)
    unmatched_own: tuple[str, ...] = ()  # of ``unmatched``, the keys of plain ``_tp_plan`` dicts (not transformers')

    def rows(self) -> list[tuple[str, str]]:
        """(module path, style) of every entry, in module order: the plan table of ``autoshard explain``."""
        return [(e.path, e.style) for e in self.entries]

    # -- checks ---------------------------------------------------------------------------------------------------
    def check(self, module: nn.Module, tp_size: int) -> None:
        """Refuse, before training, a layout that would fail or train wrongly on ``tp_size`` tensor-parallel ranks."""
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise IntentError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}. Fix: tensor_parallel_size=2")
        if tp_size == 1:
            return
        self._check_styles()
        modules = dict(module.named_modules())
        self._check_something_split(module, modules, tp_size)
        self._check_module_types(modules)
        self._check_pairs(modules, tp_size)
        self._check_ties(module, modules)
        self._check_divisible(modules, tp_size)
        if self.unmatched_own:
            warnings.warn(
                f"autoshard: the tensor-parallel plan of {', '.join(self.sources)} has key(s) that name no module of"
                f" {type(module).__name__}: {self._unmatched_words(modules)}; the modules they meant stay whole on every"
                f" tensor-parallel rank. Fix: {self._rename_fix(modules)}, or remove those keys",
                stacklevel=2,
            )

    def _check_styles(self) -> None:
        bad: dict[str, list[str]] = {}
        for e in self.entries:
            if e.spec is None or (e.is_param and e.spec.kind is not StyleKind.REPLICATE):
                bad.setdefault(e.style, []).append(e.path)
        if not bad:
            return
        order = sorted(bad, key=lambda s: (s not in MOE_STYLES, s not in OTHER_STYLES, s))
        parts = []
        for style in order:
            why = MOE_STYLES.get(style) or OTHER_STYLES.get(style) or ("a parameter-level rule" if style in STYLES else "not a style autoshard knows")
            parts.append(f"'{style}' ({why}) on {_some(bad[style])}")
        moe = any(s in MOE_STYLES for s in bad)
        raise IncompatibleBackendError(
            f"the tensor-parallel plan of {', '.join(self.sources)} uses {'styles' if len(bad) > 1 else 'a style'} autoshard"
            f" does not apply: {'; '.join(parts)}. autoshard applies {', '.join(STYLES)} to whole modules"
            + (" and has no mixture-of-experts layout yet" if moe else "")
            + ". Fix: set tensor_parallel_size=1 (FSDP alone), or pass FSDP2Strategy(parallelize_fn=fn), where fn lays out"
            " these modules itself on device_mesh['tensor_parallel']"
        )

    def _check_something_split(self, module: nn.Module, modules: dict[str, nn.Module], tp_size: int) -> None:
        """A plan that splits no module (every key misspelt, or only whole styles) would train tp_size whole copies."""
        if any(not e.is_param and e.spec is not None and e.spec.kind in SPLITTING for e in self.entries):
            return
        name = type(module).__name__
        if self.unmatched and not self.entries:
            what = f"matches no module of {name}: {self._unmatched_words(modules)}"
        else:
            given = _some([e.path for e in self.entries])
            what = f"splits no module of {name}: it gives {given} only {', '.join(sorted({e.style for e in self.entries}))} (whole on every rank)"
            what += f", and {self._unmatched_words(modules)} name no module" if self.unmatched else ""
        root = self._root_of(self.unmatched[0])[0] if self.unmatched else self.roots[0]
        owner = type(modules[root]).__name__
        raise IntentError(
            f"the tensor-parallel plan of {', '.join(self.sources)} {what}, so nothing would be split across the"
            f" {tp_size} tensor-parallel ranks and they would all train on the same batch. {owner}'s Linear and Embedding"
            f" layers: {_some(_layers_under(modules, root), _MOST_LISTED) or 'none'}. Fix: {self._rename_fix(modules)}, or set tensor_parallel_size=1"
        )

    def _root_of(self, key: str) -> tuple[str, str]:
        """(the root whose plan holds ``key``, the key as written in that plan: relative to the root)."""
        root = max((r for r in self.roots if r and key.startswith(r + ".")), key=len, default="")
        return root, key[len(root) + 1 :] if root else key

    def _renames(self, modules: dict[str, nn.Module]) -> dict[str, str | None]:
        """{each plan key that names nothing, as written: the closest module path under its root, layer numbers as
        ``*``, or None}."""
        out: dict[str, str | None] = {}
        for key in self.unmatched_own or self.unmatched:
            root, written = self._root_of(key)
            close = difflib.get_close_matches(written, _layers_under(modules, root), n=1, cutoff=0.6)
            out[written] = close[0] if close else None
        return out

    def _unmatched_words(self, modules: dict[str, nn.Module]) -> str:
        """The plan keys that name nothing, each with its closest module path (layer numbers as ``*``) if one is close."""
        renames = list(self._renames(modules).items())
        words = [f"'{key}'" + (f" (did you mean '{close}'?)" if close else "") for key, close in renames[:_MOST_LISTED]]
        return ", ".join(words) + (f" (+{len(renames) - _MOST_LISTED} more)" if len(renames) > _MOST_LISTED else "")

    def _rename_fix(self, modules: dict[str, nn.Module]) -> str:
        renames = self._renames(modules)
        shape = "keys are module paths below the module that carries the plan, '*' for one path component such as a layer number"
        if renames and all(renames.values()):
            return f"rename the plan's keys: {', '.join(f'{k!r} -> {v!r}' for k, v in renames.items())} ({shape})"
        return f"write the plan's keys as the module paths listed ({shape}), with the styles 'colwise' and 'rowwise'"

    def _check_pairs(self, modules: dict[str, nn.Module], tp_size: int) -> None:
        """Megatron's pair: only a rowwise layer takes the slice a colwise one hands on; a plan with one kind and not
        the other fails in the first forward with a matmul shape error."""
        split = [e for e in self.entries if not e.is_param and e.spec is not None]
        colwise = [e for e in split if e.spec.kind is StyleKind.COLWISE and not e.spec.gather_output]  # type: ignore[union-attr]
        rowwise = [e for e in split if e.spec.kind is StyleKind.ROWWISE and not e.spec.split_input]  # type: ignore[union-attr]
        if colwise and not rowwise:
            first = colwise[0]
            features = getattr(modules[first.path], "out_features", 0)
            reader = _next_linear(modules, first.path, self)
            fix = (
                f"give the layer that reads each colwise output the style 'rowwise' (e.g. add {_key_of(reader)!r}: 'rowwise' if"
                f" '{reader}' reads the output of '{first.path}')"
                if reader
                else "give the layer that reads each colwise output the style 'rowwise'"
            )
            raise IncompatibleBackendError(
                f"the tensor-parallel plan of {', '.join(self.sources)} splits {_some(_keys(colwise))} colwise and nothing"
                f" rowwise: a colwise layer hands on only this rank's slice of its output features ({features // tp_size}"
                f" of {features} for '{first.path}' on {tp_size} ranks), which only a rowwise layer reading it can take,"
                f" so the next layer would fail in the first forward with a matmul shape error. Fix: {fix}, or make a layer"
                f" whose whole output is needed (a final head) 'colwise_gather_output'"
            )
        if rowwise and not colwise:
            first = rowwise[0]
            features = getattr(modules[first.path], "in_features", 0)
            raise IncompatibleBackendError(
                f"the tensor-parallel plan of {', '.join(self.sources)} splits {_some(_keys(rowwise))} rowwise and nothing"
                f" colwise: a rowwise layer takes only this rank's slice of its input features ({features // tp_size} of"
                f" {features} for '{first.path}' on {tp_size} ranks), which only a colwise layer before it hands on, so it"
                f" would fail in the first forward with a matmul shape error. Fix: give the layer that feeds each rowwise one"
                f" the style 'colwise', or use 'rowwise_split_input' (it takes a whole input and splits it itself)"
            )

    def _check_module_types(self, modules: dict[str, nn.Module]) -> None:
        for e in self.entries:
            wanted = e.spec.module_type if e.spec else None
            if wanted is None or e.is_param or isinstance(modules[e.path], wanted):
                continue
            raise IncompatibleBackendError(
                f"the tensor-parallel plan gives '{e.path}' ({type(modules[e.path]).__name__}) the style '{e.style}',"
                f" which splits {wanted.__name__} layers only (torch's parallel styles). Fix: set tensor_parallel_size=1,"
                f" or pass FSDP2Strategy(parallelize_fn=fn) that lays out '{e.path}' itself"
            )

    def _check_ties(self, module: nn.Module, modules: dict[str, nn.Module]) -> None:
        for homes in _tied(module).values():
            splits = {home: self._split_of(modules, home) for home in homes}
            if len(set(splits.values())) > 1:
                shown = "; ".join(f"'{path}.{attr}' {_split_words(s)}" for (path, attr), s in splits.items())
                names = " and ".join(f"'{p}.{a}'" for p, a in homes)
                raise IncompatibleBackendError(
                    f"{names} are one tied tensor, but the tensor-parallel plan would split it two ways: {shown}. One"
                    f" tensor has one layout. Fix: untie them (e.g. config.tie_word_embeddings=False), or give both"
                    f" modules styles that split the same dimension (a colwise lm_head with an 'embedding_rowwise'"
                    f" input embedding)"
                )

    def _split_of(self, modules: dict[str, nn.Module], home: tuple[str, str]) -> int | None:
        path, attr = home
        spec = self.style_of(path)
        return spec.split_dim(attr) if spec else None

    def style_of(self, path: str) -> Style | None:
        """The style of module ``path`` under this plan, or None when no entry names it."""
        for e in self.entries:
            if e.path == path and not e.is_param:
                return e.spec
        return None

    def _check_divisible(self, modules: dict[str, nn.Module], tp_size: int) -> None:
        """Heads first (the constraint users know), then every split dimension; the sizes that work divide all."""
        heads = self._head_counts(modules)
        dims: list[tuple[str, int]] = []
        for e in self.entries:
            if e.is_param or e.spec is None:
                continue
            for attr, p in modules[e.path].named_parameters(recurse=False):
                dim = e.spec.split_dim(attr)
                if dim is not None and p.dim() > dim:
                    dims.append((f"'{e.path}.{attr}' dimension {dim} ({e.style})", int(p.shape[dim])))
        every = [n for _, counts in heads for _, n in counts] + [n for _, n in dims]
        works = divisors(math.gcd(*every)) if every else [1]
        fix = f"Fix: tensor_parallel_size= one of {', '.join(map(str, works))}"
        for path, counts in heads:
            if any(n % tp_size for _, n in counts):
                numbers = " and ".join(f"{name}={n}" for name, n in counts)
                raise IntentError(
                    f"tensor_parallel_size={tp_size} does not divide the attention heads of '{path}' ({numbers}): each"
                    f" tensor-parallel rank must hold whole query and key/value heads. {fix}"
                )
        for what, n in dims:
            if n % tp_size:
                raise IntentError(
                    f"tensor_parallel_size={tp_size} does not divide {what}, which is {n}: each tensor-parallel rank must"
                    f" hold an equal slice (fully_shard then splits that slice again over the data-parallel ranks). {fix}"
                )

    def _head_counts(self, modules: dict[str, nn.Module]) -> list[tuple[str, list[tuple[str, int]]]]:
        """(attention module path, [(count name, value)]) for each attention whose projections are split by heads."""
        out: dict[str, list[tuple[str, int]]] = {}
        for e in self.entries:
            spec = e.spec
            if e.is_param or spec is None or spec.kind is not StyleKind.COLWISE or spec.gather_output:
                continue
            parent, _, leaf = e.path.rpartition(".")
            owner = modules.get(parent)
            if owner is None or parent in out or (leaf not in ATTENTION_PROJECTIONS and "attention" not in type(owner).__name__.lower()):
                continue
            counts = _heads_of(owner)
            if counts:
                out[parent] = counts
        return list(out.items())

    def colwise_siblings(self) -> dict[str, list[str]]:
        """{parent path: its colwise children}, for parents with two or more (q/k/v, gate/up): they share one input."""
        groups: dict[str, list[str]] = {}
        for e in self.entries:
            if not e.is_param and e.spec is not None and e.spec.kind is StyleKind.COLWISE and e.path:
                groups.setdefault(e.path.rpartition(".")[0], []).append(e.path)
        return {parent: children for parent, children in groups.items() if len(children) > 1}

    # -- what the layout costs (explain, memory) -------------------------------------------------------------------
    def split_params(self, module: nn.Module) -> dict[str, int]:
        """{parameter name: the dimension the layout splits across tensor-parallel ranks}, names as
        ``module.named_parameters()`` gives them (a tied tensor once); parameters not listed are whole on each rank."""
        modules = dict(module.named_modules())
        homes = _homes(module)
        out: dict[str, int] = {}
        for name, p in module.named_parameters():
            dims = {self._split_of(modules, home) for home in homes.get(id(p), [])} - {None}
            if dims:
                out[name] = dims.pop()  # type: ignore[assignment]  # check() refused a tensor split two ways
        return out

    def collectives(self, module: nn.Module) -> list[TPCollective]:
        """The collectives the layout adds to one training step, per module (torch's styles, no sequence parallel);
        colwise siblings that read one input (``SharedInput``) all-reduce its gradient once."""
        modules = dict(module.named_modules())
        out: list[TPCollective] = []
        shared = {c: parent for parent, children in self.colwise_siblings().items() for c in children}
        counted: set[str] = set()
        for e in self.entries:
            spec, sub = e.spec, modules.get(e.path)
            if e.is_param or spec is None or sub is None:
                continue
            size_in = getattr(sub, "in_features", getattr(sub, "num_embeddings", 0))
            size_out = getattr(sub, "out_features", getattr(sub, "embedding_dim", 0))
            if spec.kind is StyleKind.COLWISE:
                if spec.gather_output:
                    out.append(TPCollective(e.path, "all-gather", "forward", size_out))
                group = shared.get(e.path)
                if group is None or group not in counted:  # siblings reading one input sum its gradient once
                    out.append(TPCollective(group or e.path, "all-reduce", "backward", size_in))
                    counted.add(group or e.path)
            elif spec.kind in (StyleKind.ROWWISE, StyleKind.EMBEDDING_ROWWISE):
                out.append(TPCollective(e.path, "all-reduce", "forward", size_out))
                if spec.split_input:
                    out.append(TPCollective(e.path, "all-gather", "backward", size_in))
            elif spec.kind is StyleKind.EMBEDDING_COLWISE:
                out.append(TPCollective(e.path, "all-gather", "forward", size_out))
            elif spec.kind is StyleKind.REPLICATE_SUM_GRADS:
                numel = sum(p.numel() for p in sub.parameters(recurse=False) if p.requires_grad)
                out.append(TPCollective(e.path, "all-reduce", "gradients", numel))
        return out

    def describe(self, module: nn.Module, tp: int) -> list[str]:
        """The layout on ``tp`` ranks in words, one line per plan key, for ``autoshard explain``."""
        modules = dict(module.named_modules())
        groups: dict[tuple[str, str], list[TPEntry]] = {}
        for e in self.entries:
            groups.setdefault((e.key, e.style), []).append(e)
        lines = [f"from {', '.join(self.sources)}; every other parameter of the plan's modules is whole on each of the {tp} ranks"]
        width = max((len(key) for key, _ in groups), default=0)
        for (key, style), entries in groups.items():
            spec, sub = entries[0].spec, modules.get(entries[0].path)
            count = f"{len(entries)} modules" if len(entries) > 1 else "1 module"
            held = ""
            if spec is not None and sub is not None and not entries[0].is_param:
                weight = sub._parameters.get("weight")
                dim = spec.split_dim("weight")
                if weight is not None and dim is not None and weight.dim() > dim:
                    local = [int(n) for n in weight.shape]
                    local[dim] //= tp
                    held = f"; weight {tuple(int(n) for n in weight.shape)} -> {tuple(local)} per rank"
            meaning = spec.meaning if spec else "not applied"
            comm = f"; {spec.collective}" if spec and spec.collective != "none" else ""
            lines.append(f"  {key:<{width}}  {style:<22} {count:>11}: {meaning}{held}{comm}")
        lines += [f"note: {n}" for n in self.notes]
        return lines

    # -- the layout -----------------------------------------------------------------------------------------------
    def apply(self, module: nn.Module, tp_mesh: DeviceMesh) -> None:
        """Lay ``module`` out on ``tp_mesh`` (1-D); tied tensors stay one Parameter. The module's own direct parameters
        stay plain tensors: the FSDP2 plan keeps those whole and averages their gradients itself. Idempotent."""
        from torch.distributed.tensor import Replicate, distribute_tensor
        from torch.distributed.tensor.parallel import parallelize_module

        if getattr(module, _APPLIED, False):
            return
        tp = tp_mesh.size()
        self.check(module, tp)
        if tp == 1:
            return
        modules = dict(module.named_modules())
        ties = _tied(module)
        styles = {e.path: _torch_style(e.spec) for e in self.entries if not e.is_param and e.spec and e.spec.module_type}
        for path, style in styles.items():  # one call per concrete path: keys are not patterns here
            parallelize_module(module, tp_mesh, {path: style} if path else style)
        for homes in ties.values():  # parallelize_module gave each home its own Parameter: one tensor again
            first = next((h for h in homes if self._split_of(modules, h) is not None), homes[0])
            shared = modules[first[0]]._parameters[first[1]]
            for path, attr in homes:
                modules[path]._parameters[attr] = shared
        self._local_head_counts(modules, tp)
        replicated: dict[int, nn.Parameter] = {}
        for path, sub in modules.items():
            if path and any(_within(path, r) for r in self.roots):
                for p in sub._parameters.values():
                    if p is not None and not _is_dtensor(p) and id(p) not in replicated:
                        replicated[id(p)] = nn.Parameter(distribute_tensor(p.detach(), tp_mesh, [Replicate()]), requires_grad=p.requires_grad)
        owners: dict[str, list[tuple[str, bool]]] = {}
        sum_grads = {e.path for e in self.entries if e.spec and e.spec.kind is StyleKind.REPLICATE_SUM_GRADS}
        for path, sub in modules.items():  # every home of a converted tensor, a tied one outside the roots included
            for attr, p in list(sub._parameters.items()):
                if path and p is not None and id(p) in replicated:
                    sub._parameters[attr] = replicated[id(p)]
                    owners.setdefault(path, []).append((attr, path in sum_grads))
        for path, params in owners.items():
            LocalParams(tuple(params)).install(modules[path])
        for parent, children in self.colwise_siblings().items():
            SharedInput(tp_mesh).install(modules[parent], [modules[c] for c in children])
        fed_by: list[tuple[str, str]] = []  # the colwise layer that ran last in the first forward: (path, plan key)
        for path, sub in modules.items():  # installed last, so each runs first: it sees the plain input
            if path and isinstance(sub, nn.Linear) and any(_within(path, r) for r in self.roots):
                FirstInput.of(self, modules, path, tp, fed_by).install(sub)
        object.__setattr__(module, _APPLIED, True)

    def _local_head_counts(self, modules: dict[str, nn.Module], tp: int) -> None:
        """Attention modules that keep their head counts as attributes (older transformers, NeMo's rewrite) get this
        rank's; transformers 5 computes heads from the projection's output shape (``view(..., -1, head_dim)``)."""
        for path, _ in self._head_counts(modules):
            owner = modules[path]
            for names in HEAD_COUNTS:
                for name in names:
                    value = vars(owner).get(name)
                    if isinstance(value, int) and not isinstance(value, bool):
                        setattr(owner, name, value // tp)
                        self.notes.append(f"'{path}.{name}' set to {value // tp} (this rank's share of {value})")


@dataclass(frozen=True)
class LocalParams:
    """Run one module's forward on the local tensors of its ``Replicate()`` DTensor parameters: its inputs are plain
    tensors (every parallel style hands back local ones). ``to_local`` is differentiable: the gradient arrives as
    ``Replicate()``, or ``Partial()`` where each rank saw only its own heads. The DTensors are put back even when the
    forward raises, before fully_shard's own post-forward hook (registered later) reshards them.
    """

    params: tuple[tuple[str, bool], ...]  # (attribute, gradient is a partial sum)

    def install(self, module: nn.Module) -> None:
        if getattr(module, "_autoshard_local_params", None) is None:
            module.register_forward_pre_hook(self.before)
            module.register_forward_hook(self.after, always_call=True)
            object.__setattr__(module, "_autoshard_local_params", self)
            for attr, partial in self.params:
                if partial:  # without fully_shard (no data-parallel ranks), nobody else sums the partial gradients
                    module._parameters[attr].register_post_accumulate_grad_hook(_sum_partial_grad)  # type: ignore[union-attr]

    def before(self, module: nn.Module, args: Any) -> None:
        from torch.distributed.tensor import Partial, Replicate

        saved = {}
        for attr, partial in self.params:
            p = module._parameters.get(attr)
            if _is_dtensor(p):
                saved[attr] = p
                module._parameters[attr] = p.to_local(grad_placements=[Partial() if partial else Replicate()])  # type: ignore[union-attr]
        object.__setattr__(module, "_autoshard_saved_params", saved)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        saved = vars(module).pop("_autoshard_saved_params", None) or {}
        for attr, p in saved.items():
            module._parameters[attr] = p


@dataclass
class FirstInput:
    """The first forward of a Linear layer inside the plan's roots checks the input features it receives against
    its layout, then removes itself. A plan that pairs colwise and rowwise layers wrongly would fail in torch's matmul
    with bare shapes; here it is refused naming the layer and the plan key to change. Any other width is left to
    fail as it would without tensor parallel.
    """

    path: str
    key: str  # the plan key to change: the entry's own, or the path with layer numbers as ``*``
    style: str  # the plan's style; "" when the plan leaves the layer whole
    features: int  # the whole layer's input features
    tp: int
    takes_slice: bool  # rowwise (not split_input): its input is this rank's slice of the features
    hands_slice: bool  # colwise (not gathering): its output is this rank's slice of the features
    fed_by: list[tuple[str, str]]  # shared by the layout's checks: the colwise layer that ran last (path, plan key)
    swapped_with: str | None = None  # a colwise layer the plan puts after this rowwise one, under the same parent
    handles: dict[str, Any] = field(default_factory=dict)  # this layer's hooks, each removed after its first call

    @classmethod
    def of(cls, plan: TPPlan, modules: dict[str, nn.Module], path: str, tp: int, fed_by: list[tuple[str, str]]) -> FirstInput:
        entry = next((e for e in plan.entries if e.path == path and not e.is_param), None)
        spec = entry.spec if entry else None
        takes_slice = spec is not None and spec.kind is StyleKind.ROWWISE and not spec.split_input
        hands_slice = spec is not None and spec.kind is StyleKind.COLWISE and not spec.gather_output
        swapped = None
        if takes_slice:
            parent, names = path.rpartition(".")[0], list(modules)
            later = [e for e in plan.entries if e.path.rpartition(".")[0] == parent and e.path in modules and names.index(e.path) > names.index(path)]
            swapped = next((e.key for e in later if e.spec and e.spec.kind is StyleKind.COLWISE and not e.spec.gather_output), None)
        key, style = (entry.key, entry.style) if entry else (_key_of(path), "")
        return cls(path, key, style, int(modules[path].in_features), tp, takes_slice, hands_slice, fed_by, swapped)

    def install(self, module: nn.Module) -> None:
        self.handles["check"] = module.register_forward_pre_hook(self.check, prepend=True)
        if self.hands_slice:
            self.handles["ran"] = module.register_forward_hook(self.ran)

    def ran(self, module: nn.Module, args: Any, output: Any) -> None:
        import torch

        if torch.compiler.is_compiling():  # traced as nothing: a compiled block is never checked, nor recompiled for it
            return
        self.fed_by[:] = [(self.path, self.key)]
        self.handles.pop("ran").remove()

    def check(self, module: nn.Module, args: Any) -> None:
        import torch

        if torch.compiler.is_compiling():
            return
        self.handles.pop("check").remove()
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or _is_dtensor(x) or x.dim() < 1:
            return
        got = int(x.shape[-1])
        if self.takes_slice and got == self.features and self.tp > 1:
            raise IncompatibleBackendError(self._fed_whole(got))
        if not self.takes_slice and got * self.tp == self.features:
            raise IncompatibleBackendError(self._fed_slice(got))

    def _fed_whole(self, got: int) -> str:
        if self.swapped_with:
            why = f"; the plan makes '{self.swapped_with}' after it colwise, so the two styles look swapped"
            fix = (
                f"swap them: {{'{self.key}': 'colwise', '{self.swapped_with}': 'rowwise'}} (the colwise layer first, then"
                f" the rowwise one that reads its output)"
            )
        else:
            why = ""
            fix = (
                f"make the layer that feeds '{self.path}' 'colwise', or give '{self.key}' the style 'rowwise_split_input'"
                f" (it takes a whole input and splits it itself)"
            )
        return (
            f"'{self.path}' is rowwise in the tensor-parallel plan ('{self.key}': '{self.style}'), so it takes this rank's"
            f" slice of its {self.features} input features ({self.features // self.tp} on each of {self.tp} ranks), which"
            f" a colwise layer before it hands on, but it receives all {got}: no colwise layer feeds it{why}. torch would"
            f" stop here with a bare matmul shape error. Fix: {fix}"
        )

    def _fed_slice(self, got: int) -> str:
        what = (
            f"is '{self.style}' in the tensor-parallel plan ('{self.key}')"
            if self.style
            else "is whole on every rank (the plan names no style for it)"
        )
        feeder_path, feeder_key = self.fed_by[0] if self.fed_by else ("", "")
        source = f"the slice the colwise '{feeder_path}' before it hands on" if feeder_path else "the slice a colwise layer before it hands on"
        gather = (
            f"make '{feeder_key}' 'colwise_gather_output' (its whole output on every rank)"
            if feeder_key
            else "make that colwise layer 'colwise_gather_output'"
        )
        if self.hands_slice:  # colwise itself: it cannot also be the rowwise partner of the layer before it
            fix = f"{gather}, or leave '{feeder_key or 'that layer'}' out of the plan: it has no rowwise partner, '{self.path}' after it is colwise"
        else:
            fix = f"give '{self.key}' the style 'rowwise' (the partner of the colwise layer whose output it reads), or {gather}"
        return (
            f"'{self.path}' {what}, so it takes all {self.features} of its input features, but it receives {got} on each"
            f" of the {self.tp} tensor-parallel ranks: {source}, which only a rowwise layer takes. torch would stop here"
            f" with a bare matmul shape error. Fix: {fix}"
        )


class SharedInput:
    """Colwise siblings (q/k/v, gate/up) that read one tensor (same object, unmodified) get one ``Replicate()``
    DTensor of it, so its backward all-reduces the summed gradient once: torch's ColwiseParallel wraps each input
    separately, five all-reduces per Llama layer where torchtitan's ``PrepareModuleInput`` issues two. The parent's
    forward hook empties the cache, so no activation outlives its forward.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.cache: dict[int, tuple[Any, int, Any]] = {}  # id(input) -> (input, its version, its DTensor)

    def install(self, parent: nn.Module, children: list[nn.Module]) -> None:
        for child in children:
            child.register_forward_pre_hook(self.convert, prepend=True)
        parent.register_forward_hook(self.clear, always_call=True)

    def convert(self, module: nn.Module, args: Any) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        if not args or _is_dtensor(args[0]) or not hasattr(args[0], "_version"):
            return None
        x = args[0]
        hit = self.cache.get(id(x))
        if hit is None or hit[0] is not x or hit[1] != x._version:
            hit = (x, x._version, DTensor.from_local(x, self.mesh, [Replicate()], run_check=False))
            self.cache[id(x)] = hit
        return (hit[2], *args[1:])

    def clear(self, module: nn.Module, args: Any, output: Any) -> None:
        self.cache.clear()


def _sum_partial_grad(param: Any) -> None:
    """A ``Replicate()`` parameter whose gradient arrived as ``Partial()``: summed over the tensor-parallel ranks
    (under ``fully_shard`` FSDP2 does this same sum itself)."""
    grad = param.grad
    if _is_dtensor(grad) and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


# -- finding the plan ---------------------------------------------------------------------------------------------
def find_tp_plan(module: nn.Module) -> TPPlan | None:
    """The tensor-parallel plan ``module`` or its submodules carry, with wildcards resolved; None when there is none.

    Outermost first: a transformers model's resolved instance ``_tp_plan``, else that plan built here the same way,
    or a plain ``_tp_plan`` dict on any module. A tied embedding the plan leaves whole gets the split that keeps it one
    tensor, as transformers does.
    """
    modules = dict(module.named_modules())
    params = dict(module.named_parameters(remove_duplicate=False))
    order = {path: i for i, path in enumerate(modules)}
    found: dict[str, TPEntry] = {}
    roots: list[str] = []
    sources: list[str] = []
    unmatched: list[str] = []
    unmatched_own: list[str] = []
    for path, sub in modules.items():
        if any(_within(path, r) for r in roots):
            continue
        raw, source = _raw_plan(sub)
        own = not (hasattr(sub, "base_model_prefix") and hasattr(getattr(sub, "config", None), "base_model_tp_plan"))
        if not raw:
            continue
        roots.append(path)
        sources.append(f"'{path}' ({source})" if path else source)
        for key, style in raw.items():
            full = _join(path, key)
            pattern = _pattern(full)
            hits = [m for m in modules if pattern.fullmatch(m) and _within(m, path)]
            if hits:
                for hit in hits:
                    found[hit] = TPEntry(hit, str(style), full)
                continue
            param_hits = [n for n in params if pattern.fullmatch(n)]
            for hit in param_hits:
                found[hit] = TPEntry(hit, str(style), full, is_param=True)
            if not param_hits:
                unmatched.append(full)
                if own:
                    unmatched_own.append(full)
    if not roots:
        return None
    notes = [f"plan key '{key}' names no module or parameter of this model: ignored" for key in unmatched]
    for root in roots:
        experts = _expert_plan(modules[root])
        if experts:
            where = f"'{root}'" if root else type(module).__name__
            notes.append(
                f"{where} also has an expert-parallel plan ({_some(list(experts))}): autoshard does not apply it, so"
                f" the experts stay whole on every tensor-parallel rank (sharded over the data-parallel ranks by fully_shard)"
            )
    entries = tuple(sorted(found.values(), key=lambda e: _order(e, order)))
    plan = TPPlan(entries, tuple(roots), tuple(sources), tuple(unmatched), notes, tuple(unmatched_own))
    added = _tie_fixes(module, plan, modules)
    plan.notes += [f"'{e.path}' gets '{e.style}': {e.why}" for e in added]
    if added:
        plan.entries = tuple(sorted((*plan.entries, *added), key=lambda e: _order(e, order)))
    return plan


def _order(entry: TPEntry, order: dict[str, int]) -> tuple[int, str]:
    owner = entry.path.rpartition(".")[0] if entry.is_param else entry.path
    return order.get(owner, len(order)), entry.path


def _raw_plan(sub: nn.Module) -> tuple[dict[str, str], str]:
    """The plan ``sub`` itself carries (keys relative to it) and where it came from; ({}, '') for none."""
    name = type(sub).__name__
    own = vars(sub).get("_tp_plan")
    config = getattr(sub, "config", None)
    is_hf = hasattr(sub, "base_model_prefix") and hasattr(config, "base_model_tp_plan")
    if isinstance(own, Mapping) and own:
        return {str(k): str(v) for k, v in own.items()}, f"{name}.tp_plan, as transformers resolved it" if is_hf else f"{name}._tp_plan"
    if is_hf:
        plan = dict(getattr(type(sub), "_tp_plan", None) or {})
        prefix = str(getattr(sub, "base_model_prefix", "") or "")
        base = getattr(sub, prefix, None) if prefix else None
        under = prefix if isinstance(base, nn.Module) and base is not sub else ""
        plan.update({_join(under, k): v for k, v in (config.base_model_tp_plan or {}).items()})  # type: ignore[union-attr]
        return plan, f"{name}._tp_plan + {type(config).__name__}.base_model_tp_plan"
    cls_plan = getattr(type(sub), "_tp_plan", None)
    if isinstance(cls_plan, Mapping) and cls_plan:
        return {str(k): str(v) for k, v in cls_plan.items()}, f"{name}._tp_plan"
    return {}, ""


def _expert_plan(sub: nn.Module) -> dict[str, str]:
    """transformers' expert-parallel plan of a model (instance ``_ep_plan``, else ``config.base_model_ep_plan``)."""
    own = vars(sub).get("_ep_plan")
    if isinstance(own, Mapping) and own:
        return dict(own)
    plan = getattr(getattr(sub, "config", None), "base_model_ep_plan", None) if hasattr(sub, "base_model_prefix") else None
    return dict(plan) if isinstance(plan, Mapping) else {}


def _tie_fixes(module: nn.Module, plan: TPPlan, modules: dict[str, nn.Module]) -> list[TPEntry]:
    """Entries that keep a tied tensor one tensor: an ``nn.Embedding`` the plan leaves whole, tied to a weight the plan
    splits, gets the embedding style that splits the same dimension (exact: the two layouts are one layout)."""
    added: list[TPEntry] = []
    for homes in _tied(module).values():
        splits = {home: plan._split_of(modules, home) for home in homes}
        split = {s for s in splits.values() if s is not None}
        if len(split) != 1:
            continue
        dim = split.pop()
        for (path, attr), s in splits.items():
            if s is None and attr == "weight" and isinstance(modules[path], nn.Embedding) and plan.style_of(path) is None:
                style = "embedding_rowwise" if dim == 0 else "embedding_colwise"
                other = next(f"{p}.{a}" for (p, a), d in splits.items() if d is not None)
                added.append(TPEntry(path, style, path, why=f"tied to '{other}', which the plan splits on dimension {dim}"))
    return added


def _homes(module: nn.Module) -> dict[int, list[tuple[str, str]]]:
    """Every (module path, attribute) that holds each parameter: id -> homes, in module order."""
    homes: dict[int, list[tuple[str, str]]] = {}
    for path, sub in module.named_modules():
        for attr, p in sub._parameters.items():
            if p is not None:
                homes.setdefault(id(p), []).append((path, attr))
    return homes


def _tied(module: nn.Module) -> dict[int, list[tuple[str, str]]]:
    return {pid: h for pid, h in _homes(module).items() if len(h) > 1}


def _heads_of(owner: nn.Module) -> list[tuple[str, int]]:
    """[(name, count)] of query and key/value heads: the module's config (transformers), else its own attributes."""
    config = getattr(owner, "config", None)
    out: list[tuple[str, int]] = []
    for names in HEAD_COUNTS:
        for source in (config, owner):
            value = next(((n, getattr(source, n)) for n in names if isinstance(getattr(source, n, None), int)), None) if source is not None else None
            if value is not None:
                out.append(value)
                break
    return out


# -- small helpers ------------------------------------------------------------------------------------------------
def _torch_style(spec: Style | None) -> Any:
    """torch's ParallelStyle for a style (every output handed back as a local tensor)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    assert spec is not None
    if spec.kind is StyleKind.COLWISE:
        return ColwiseParallel(output_layouts=Replicate()) if spec.gather_output else ColwiseParallel()
    if spec.kind is StyleKind.ROWWISE:
        return RowwiseParallel(input_layouts=Replicate()) if spec.split_input else RowwiseParallel()
    if spec.kind is StyleKind.EMBEDDING_ROWWISE:
        return RowwiseParallel(input_layouts=Replicate())  # token ids whole on every rank; partial lookups summed
    if spec.kind is StyleKind.EMBEDDING_COLWISE:
        return ColwiseParallel(output_layouts=Replicate())
    raise AssertionError(spec)


def _is_dtensor(p: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _pattern(key: str) -> re.Pattern[str]:
    """A plan key as a regular expression: ``*`` is one path component (transformers uses it for layer numbers)."""
    return re.compile(r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in key.split(".")))


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix and key else prefix or key


def _within(path: str, root: str) -> bool:
    return not root or path == root or path.startswith(root + ".")


def _some(paths: list[str], most: int = _MOST_NAMED) -> str:
    shown = ", ".join(f"'{p}'" for p in paths[:most])
    return shown + (f" (+{len(paths) - most} more)" if len(paths) > most else "")


def _key_of(path: str) -> str:
    """A module path as a plan key: every layer number (an all-digit component) as ``*``."""
    return ".".join("*" if part.isdigit() else part for part in path.split("."))


def _keys(entries: list[TPEntry]) -> list[str]:
    return list(dict.fromkeys(e.key for e in entries))


def _layers_under(modules: dict[str, nn.Module], root: str) -> list[str]:
    """The Linear and Embedding layers under ``root``, relative to it, as plan keys (layer numbers as ``*``), in order."""
    inside = [p for p, m in modules.items() if p != root and _within(p, root) and isinstance(m, (nn.Linear, nn.Embedding))]
    return list(dict.fromkeys(_key_of(p[len(root) + 1 :] if root else p) for p in inside))


def _next_linear(modules: dict[str, nn.Module], path: str, plan: TPPlan) -> str | None:
    """The first nn.Linear after ``path`` in module order under the same parent that the plan leaves whole: the
    likely reader of its output (a guess, offered as one in a Fix)."""
    parent = path.rpartition(".")[0]
    names = list(modules)
    for other in names[names.index(path) + 1 :]:
        if other.rpartition(".")[0] == parent and isinstance(modules[other], nn.Linear) and plan.style_of(other) is None:
            return other
    return None


def _split_words(dim: int | None) -> str:
    return "kept whole" if dim is None else f"split on dimension {dim}"
