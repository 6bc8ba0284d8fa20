"""Streaming DiLoCo's fragments: which parameters (and buffers) synchronise together.

By default (``fragments=F``) strided groups of whole blocks, as the paper's (Douillard et al. 2025,
"Streaming DiLoCo with overlapping communication", arXiv 2501.18512): the blocks of the model's stacks
of repeated blocks go to fragment ``i mod F``; or the user's own lists of modules or module names. See
:func:`fragment_assignment`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch

from lightning_gradcomp.local.config import FragmentEntry, LocalUpdates


def fragment_assignment(module: torch.nn.Module, names: Sequence[str], config: LocalUpdates,
                        first_use: Optional[Mapping[str, int]] = None) -> list[int]:
    """The fragment of each of ``module``'s trainable parameters ``names`` (in ``named_parameters`` order),
    for ``config.fragments`` (see :class:`~lightning_gradcomp.local.config.LocalUpdates`): an int ``F``, strided
    groups of whole blocks (Douillard et al. 2025 compare "sequential" and "strided" fragments and keep
    strided; :func:`strided_blocks`, where torchtitan's fragments put the parameters outside the blocks),
    ordered by ``first_use`` (module name -> the order of its first call in a forward pass, :class:`FirstUse`)
    where it knows the module, else by registration (a model that registers its output layer first, as LitGPT's
    GPT does, is right once the loops recorded a forward pass), or :func:`assign_fragments`' modules dealt out
    in turn where the blocks do not apply; or the fragments themselves (:func:`assign_fragments`; a slice of
    a stack, ``model.layers[:2]``, stands for its blocks).
    """
    fragments = config.fragments
    if isinstance(fragments, int):
        if fragments == 1:
            return [0] * len(names)
        if uses_block_strides(module, names, config):
            return strided_blocks(names, repeated_blocks(module, names), fragments, first_use)
        return assign_fragments(names, fragments)
    module_names = {id(sub): name for name, sub in module.named_modules()}
    resolved = []
    for index, entries in enumerate(fragments):
        named = []
        for entry in entries:
            if not isinstance(entry, torch.nn.Module):
                named.append(entry)
                continue
            # a slice of a stack (``model.layers[:2]``) is a new container of the model's own blocks
            parts = [entry] if id(entry) in module_names or not _is_stack(entry) else list(entry.children())
            if not parts or any(id(part) not in module_names for part in parts):
                raise ValueError(f"`fragments`: fragment {index} holds a {type(entry).__name__} that is not a "
                                 "submodule of the model (modules are matched by identity, and a copy made by "
                                 "pickling or deepcopy is another module); give its name instead, e.g. "
                                 "'layers.0'")
            named.extend(module_names[id(part)] for part in parts)
        resolved.append(tuple(named))
    return assign_fragments(names, tuple(resolved))


def assign_fragments(names: Sequence[str], fragments: Union[int, Sequence[Sequence[FragmentEntry]]]) -> list[int]:
    """The fragment of each parameter, from the names alone.

    ``fragments`` an int: modules (a parameter's name without its last component) in order of first
    appearance, module ``i`` to fragment ``i mod fragments``; a module's parameters stay together (the
    fallback of :func:`fragment_assignment`, which sees the blocks).

    ``fragments`` the fragments, each a sequence of module names: a parameter belongs to the fragment of the
    names it equals or starts with followed by a dot (``"layers.1"`` holds ``"layers.1.weight"``, not
    ``"layers.10.weight"``; ``""``, the root module, holds every parameter). Every name must hold a
    trainable parameter and every parameter must belong to exactly one fragment, else a ``ValueError``
    naming them.
    """
    if isinstance(fragments, int):
        modules: dict[str, int] = {}
        for name in names:
            modules.setdefault(name.rpartition(".")[0], len(modules))
        if len(modules) < fragments:
            raise ValueError(f"`fragments` ({fragments}) must be at most the number of modules with trainable "
                             f"parameters ({len(modules)})")
        return [modules[name.rpartition(".")[0]] % fragments for name in names]
    by_name: dict[str, set[int]] = {}
    for index, entries in enumerate(fragments):
        for entry in entries:
            if not isinstance(entry, str):
                raise ValueError(f"`fragments`: fragment {index} holds a {type(entry).__name__}; modules are resolved "
                                 "to their names with the model (fragment_assignment(module, names, config)); give "
                                 "module names here")
            by_name.setdefault(entry, set()).add(index)
    owners: list[set[int]] = []
    used: set[str] = set()
    for name in names:
        parts = name.split(".")
        prefixes = [".".join(parts[:depth]) for depth in range(len(parts) + 1)]
        hits = [prefix for prefix in prefixes if prefix in by_name]
        used.update(hits)
        owners.append(set().union(*(by_name[prefix] for prefix in hits)))
    unused = [entry for entry in by_name if entry not in used]
    if unused:
        tops = sorted({name.split(".")[0] for name in names})
        raise ValueError(f"`fragments`: {_listed(unused)} name{'' if len(unused) > 1 else 's'} no module with "
                         f"trainable parameters (a name is a module's, e.g. 'layers.0'; the model's top-level "
                         f"names: {_listed(tops)})")
    twice = [(name, sorted(owner)) for name, owner in zip(names, owners) if len(owner) > 1]
    if twice:
        name, where = twice[0]
        raise ValueError(f"`fragments`: every trainable parameter must belong to exactly one fragment; {len(twice)} "
                         f"belong to several: {_listed([name for name, _ in twice])} ({name!r} is in fragments "
                         f"{where})")
    missing = [name for name, owner in zip(names, owners) if not owner]
    if missing:
        raise ValueError(f"`fragments`: every trainable parameter must belong to exactly one fragment; {len(missing)} "
                         f"belong to none: {_listed(missing)}")
    return [min(owner) for owner in owners]


def repeated_blocks(module: torch.nn.Module, names: Sequence[str]) -> list[str]:
    """The names of ``module``'s blocks, in registration order: the children of its stacks, each an
    ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict`` whose children that hold trainable parameters
    (``names``) are two or more of one class (``nn.TransformerEncoder.layers``, a GPT's ``h``, a ResNet's
    ``layer1``…``layer4``); a stack inside a block (a mixture of experts' ``experts``) is part of its block.
    Children without trainable parameters (``Dropout``, frozen layers) are not blocks."""
    holding: set[str] = set()  # the modules with trainable parameters under them
    for name in names:
        parts = name.split(".")
        holding.update(".".join(parts[:depth]) for depth in range(len(parts)))
    blocks: list[str] = []
    stacks: list[str] = []
    for prefix, container in module.named_modules():  # parents before children
        if not _is_stack(container):
            continue
        if any(_within(prefix, stack) for stack in stacks):
            continue
        children = [(f"{prefix}.{key}" if prefix else key, child) for key, child in container.named_children()]
        children = [(name, child) for name, child in children if name in holding]
        if len(children) >= 2 and len({type(child) for _, child in children}) == 1:
            stacks.append(prefix)
            blocks.extend(name for name, _ in children)
    return blocks


def strided_blocks(names: Sequence[str], blocks: Sequence[str], fragments: int,
                   first_use: Optional[Mapping[str, int]] = None) -> list[int]:
    """Block ``i`` (of ``blocks``, module names) to fragment ``i mod fragments``; a parameter outside the
    blocks to fragment 0 when it comes before the first block, else to the last. "Before": its module's
    first call precedes every block's in ``first_use`` (module name -> order of first call) where both are
    known, else its name precedes the first block's parameters in ``names``."""
    index = {block: number for number, block in enumerate(blocks)}
    called = [first_use[block] for block in blocks if first_use and block in first_use]
    first_block_call = min(called) if called else None
    result = []
    seen = False
    for name in names:
        parts = name.split(".")
        owner = next((index[prefix] for prefix in (".".join(parts[:depth]) for depth in range(1, len(parts)))
                      if prefix in index), None)
        seen = seen or owner is not None
        if owner is not None:
            result.append(owner % fragments)
            continue
        module = name.rpartition(".")[0]
        if first_block_call is not None and first_use is not None and module in first_use:
            result.append(0 if first_use[module] < first_block_call else fragments - 1)
        else:
            result.append(fragments - 1 if seen else 0)
    return result


def uses_block_strides(module: torch.nn.Module, names: Sequence[str], config: LocalUpdates) -> bool:
    """Whether ``config.fragments`` groups ``module``'s parameters by strided blocks (:func:`fragment_assignment`'s
    default), where the order of first use decides the parameters outside the blocks."""
    fragments = config.fragments
    if not isinstance(fragments, int) or fragments == 1:
        return False
    blocks = repeated_blocks(module, names)
    owners = {name.rpartition(".")[0] for name in names}
    inside = {owner for owner in owners if any(_within(owner, block) for block in blocks)}
    return len(blocks) >= fragments and 2 * len(inside) >= len(owners)


class FirstUse:
    """The order in which a model's modules are first called in forward passes (``order``: module name ->
    rank), recorded by forward pre-hooks until :meth:`stop`.

    Inside a compiled graph the hooks record nothing (``torch.compiler.is_compiling()``) and the order stays
    empty (the registration order stands); the loop then keeps them, as no-ops after :meth:`stop`, until the
    handle closes (removing them would make the ``torch.compile``'d model compile again). Where eager passes
    recorded the order, the loop removes them once it is settled: no cost per forward pass afterwards."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.order: dict[str, int] = {}
        self.recording = True
        self._handles = [sub.register_forward_pre_hook(self._hook(name)) for name, sub in module.named_modules()]

    def _hook(self, name: str):  # noqa: ANN202 - a forward pre-hook
        def record(_module: torch.nn.Module, _args: Any) -> None:
            if self.recording and not torch.compiler.is_compiling():
                self.order.setdefault(name, len(self.order))
        return record

    def stop(self) -> dict[str, int]:
        """Stop recording; the order so far."""
        self.recording = False
        return self.order

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def checked_assignment(fragment_of: Sequence[int], names: Sequence[str], fragments: int) -> list[int]:
    """``fragment_of`` (one fragment in ``[0, fragments)`` per parameter, every fragment non-empty) as a
    list, else a ``ValueError``."""
    fragment_of = [int(owner) for owner in fragment_of]
    if len(fragment_of) != len(names):
        raise ValueError(f"gradcomp: {len(fragment_of)} fragment numbers for {len(names)} parameters")
    if any(not 0 <= owner < fragments for owner in fragment_of):
        raise ValueError(f"gradcomp: fragment numbers must lie in [0, {fragments - 1}], got {sorted(set(fragment_of))}")
    empty = sorted(set(range(fragments)) - set(fragment_of))
    if empty:
        raise ValueError(f"`fragments`: fragment{'s' if len(empty) > 1 else ''} {empty} would hold no trainable "
                         "parameter; every fragment must hold some")
    return fragment_of


def buffer_fragments(buffer_names: Sequence[str], param_names: Sequence[str], fragment_of: Sequence[int],
                     fragments: int) -> list[int]:
    """The fragment of each buffer: its module's; for a module without trainable parameters, that of its
    nearest enclosing module whose parameters are all in one fragment (a block's rotary-embedding buffers
    go with the block); else the last fragment (synchronised at the end of each window)."""
    by_module = {name.rpartition(".")[0]: fragment for name, fragment in zip(param_names, fragment_of)}
    enclosing: dict[str, set[int]] = {}
    for name, fragment in zip(param_names, fragment_of):
        parts = name.split(".")
        for depth in range(len(parts)):
            enclosing.setdefault(".".join(parts[:depth]), set()).add(fragment)

    def fragment(buffer: str) -> int:
        module = buffer.rpartition(".")[0]
        if module in by_module:
            return by_module[module]
        parts = module.split(".") if module else []
        for depth in range(len(parts), -1, -1):
            owners = enclosing.get(".".join(parts[:depth]))
            if owners is not None:
                return next(iter(owners)) if len(owners) == 1 else fragments - 1
        return fragments - 1

    return [fragment(name) for name in buffer_names]


def _is_stack(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a container of blocks: ``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``."""
    return isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict))


def _within(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or inside it (``""``: the root, holds everything)."""
    return not prefix or name == prefix or name.startswith(prefix + ".")


def _listed(items: Sequence[str], most: int = 8) -> str:
    """``'a', 'b', …`` (at most ``most``, then how many more)."""
    shown = ", ".join(repr(item) for item in items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")
