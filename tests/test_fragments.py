"""Streaming DiLoCo's fragments (issue 36, items 13 and 14): strided groups of whole blocks by default,
the user's own fragments (by name or by module), and ``overlap="before"``, torchft's schedule, step by
step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_gradcomp.local import LocalUpdates, SimulatedLocalUpdates
from lightning_gradcomp.local.fragments import assign_fragments, buffer_fragments, fragment_assignment, repeated_blocks
from lightning_gradcomp.local.outer import OuterModel, trainable_parameters
from tests._local_workers import inner_optimizer, inner_step, small_model


class TinyLM(nn.Module):
    """An embedding, ``nn.TransformerEncoder`` (4 layers and a final norm) and an output layer."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(16), enable_nested_tensor=False)
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def names_of(model: nn.Module) -> list[str]:
    return [name for name, _ in trainable_parameters(model)]


def by_fragment(names: list[str], fragment_of: list[int]) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = {}
    for name, fragment in zip(names, fragment_of):
        groups.setdefault(fragment, []).append(name)
    return groups


def owner_module(name: str, depth: int = 3) -> str:
    """``encoder.layers.2.linear1.weight`` → ``encoder.layers.2``; ``head.weight`` → ``head``."""
    parts = name.split(".")
    return ".".join(parts[:depth]) if parts[:2] == ["encoder", "layers"] else parts[0]


# ------------------------------------------------------------------ the default: strided whole blocks
def test_transformer_encoder_fragments_are_whole_layers_strided() -> None:
    """2 fragments: layers 0, 2 and the embedding in one, layers 1, 3, the final norm and the output layer in
    the other; no layer is split (the modules dealt out in turn gave one fragment every block's
    ``in_proj``/``linear1``/``norm1`` and the other its ``out_proj``/``linear2``/``norm2``)."""
    model = TinyLM()
    names = names_of(model)
    assert repeated_blocks(model, names) == [f"encoder.layers.{i}" for i in range(4)]
    fragment_of = fragment_assignment(model, names, LocalUpdates(4, fragments=2))
    modules = {fragment: sorted({owner_module(name) for name in group})
               for fragment, group in by_fragment(names, fragment_of).items()}
    assert modules == {0: ["embed", "encoder.layers.0", "encoder.layers.2"],
                       1: ["encoder", "encoder.layers.1", "encoder.layers.3", "head"]}  # "encoder": its norm
    assert [fragment_of[names.index(n)] for n in ("encoder.norm.weight", "head.bias")] == [1, 1]


def test_four_fragments_of_eight_layers_hold_layers_p_and_p_plus_4() -> None:
    model = TinyLM(layers=8)
    names = names_of(model)
    fragment_of = fragment_assignment(model, names, LocalUpdates(8, fragments=4))
    for layer in range(8):
        owners = {fragment_of[i] for i, name in enumerate(names) if name.startswith(f"encoder.layers.{layer}.")}
        assert owners == {layer % 4}, layer
    assert fragment_of[names.index("embed.weight")] == 0 and fragment_of[names.index("head.weight")] == 3


def test_frozen_blocks_and_parameterless_children_are_not_blocks() -> None:
    """Blocks are the children holding trainable parameters: frozen first layers are skipped, and the
    remaining ones are dealt out from fragment 0."""
    model = TinyLM()
    for p in model.encoder.layers[0].parameters():
        p.requires_grad_(False)
    names = names_of(model)
    assert repeated_blocks(model, names) == [f"encoder.layers.{i}" for i in (1, 2, 3)]
    fragment_of = fragment_assignment(model, names, LocalUpdates(4, fragments=2))
    assert {fragment_of[i] for i, n in enumerate(names) if n.startswith("encoder.layers.1.")} == {0}
    assert {fragment_of[i] for i, n in enumerate(names) if n.startswith("encoder.layers.2.")} == {1}


def test_stacks_inside_a_block_belong_to_the_block() -> None:
    """A block holding its own stack (experts) is one block; the outermost stack is the one dealt out."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    model = nn.Sequential()
    model.add_module("blocks", nn.ModuleList([Block() for _ in range(4)]))
    names = names_of(model)
    assert repeated_blocks(model, names) == [f"blocks.{i}" for i in range(4)]
    fragment_of = fragment_assignment(model, names, LocalUpdates(4, fragments=2))
    assert fragment_of[names.index("blocks.1.experts.3.weight")] == fragment_of[names.index("blocks.1.norm.weight")]


def test_encoder_decoder_stacks_are_dealt_out_together() -> None:
    """``nn.Transformer``: the encoder's layers and the decoder's, in registration order, one strided list."""
    model = nn.Transformer(16, 2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16, batch_first=True)
    names = names_of(model)
    blocks = repeated_blocks(model, names)
    assert blocks == ["encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1"]
    fragment_of = fragment_assignment(model, names, LocalUpdates(2, fragments=2))
    expected = {"encoder.layers.0": 0, "encoder.layers.1": 1, "decoder.layers.0": 0, "decoder.layers.1": 1}
    for i, name in enumerate(names):
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        assert fragment_of[i] == (expected[block] if block else 1), name  # the final norms: the last fragment


def test_models_without_a_block_stack_keep_their_modules_dealt_out_in_turn() -> None:
    """No stack of one class (the tests' MLP mixes Linear and BatchNorm), or a stack too small to matter
    (a 2-layer head under a model of many other modules): module ``i`` to fragment ``i mod F``, as before."""
    model = small_model()
    names = names_of(model)
    assert repeated_blocks(model, names) == []
    assert fragment_assignment(model, names, LocalUpdates(3, fragments=3)) == [0, 0, 1, 1, 2, 2, 0]
    assert assign_fragments(names, 3) == [0, 0, 1, 1, 2, 2, 0]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv1d(2, 8, 3), nn.BatchNorm1d(8)
            self.conv2, self.bn2 = nn.Conv1d(8, 8, 3), nn.BatchNorm1d(8)
            self.conv3, self.proj = nn.Conv1d(8, 8, 3), nn.Linear(8, 8)
            self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    model = Net()
    names = names_of(model)
    assert repeated_blocks(model, names) == ["head.0", "head.2"]  # 2 of the 8 modules with parameters
    assert fragment_assignment(model, names, LocalUpdates(2, fragments=2)) == assign_fragments(names, 2)


def test_a_block_stack_with_fewer_blocks_than_fragments_falls_back() -> None:
    model = TinyLM(layers=2)
    names = names_of(model)
    assert fragment_assignment(model, names, LocalUpdates(4, fragments=4)) == assign_fragments(names, 4)


def test_a_blocks_parameterless_buffers_go_with_the_block() -> None:
    """A buffer of a module without trainable parameters (a block's rotary table) goes with the nearest
    enclosing module whose parameters are in one fragment; a top-level one with the last fragment."""
    class Rotary(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(4))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)
            self.rope = Rotary()

    model = nn.Module()
    model.blocks = nn.ModuleList([Block() for _ in range(4)])
    model.register_buffer("mask", torch.ones(2))
    names = names_of(model)
    fragment_of = fragment_assignment(model, names, LocalUpdates(4, fragments=2))
    buffers = [name for name, _ in model.named_buffers()]
    assert buffers == ["mask"] + [f"blocks.{i}.rope.inv_freq" for i in range(4)]
    owners = dict(zip(buffers, buffer_fragments(buffers, names, fragment_of, 2)))
    assert [owners[f"blocks.{i}.rope.inv_freq"] for i in range(4)] == [0, 1, 0, 1]
    assert owners["mask"] == 1


# ------------------------------------------------------------------ the user's fragments
LM_HALVES = [["embed", "encoder.layers.0", "encoder.layers.1"],
             ["encoder.layers.2", "encoder.layers.3", "encoder.norm", "head"]]


def test_user_fragments_by_name_and_by_module_are_the_same() -> None:
    model = TinyLM()
    names = names_of(model)
    by_name = fragment_assignment(model, names, LocalUpdates(4, fragments=LM_HALVES))
    layers = model.encoder.layers
    modules = [[model.embed, layers[0], layers[1]], [layers[2], layers[3], model.encoder.norm, model.head]]
    assert fragment_assignment(model, names, LocalUpdates(4, fragments=modules)) == by_name
    assert assign_fragments(names, LocalUpdates(4, fragments=LM_HALVES).fragments) == by_name  # names alone
    cut = names.index("encoder.layers.2.self_attn.in_proj_weight")
    assert by_name == [0] * cut + [1] * (len(names) - cut)
    mixed = [["embed", layers[0], "encoder.layers.1"], [layers[2], "encoder.layers.3", "encoder.norm", "head"]]
    assert fragment_assignment(model, names, LocalUpdates(4, fragments=mixed)) == by_name
    slices = [[model.embed, layers[:2]], [layers[2:], model.encoder.norm, model.head]]  # new ModuleLists
    assert fragment_assignment(model, names, LocalUpdates(4, fragments=slices)) == by_name


def test_user_fragments_are_normalised_and_counted() -> None:
    config = LocalUpdates(6, fragments=[["a", "b"], "c", ("d",)])
    assert config.fragments == (("a", "b"), ("c",), ("d",)) and config.fragment_count == 3
    assert hash(config) == hash(LocalUpdates(6, fragments=(("a", "b"), ("c",), ("d",))))
    assert LocalUpdates(6, fragments=3).fragment_count == 3


@pytest.mark.parametrize("fragments,match", [
    ([["embed", "encoder.layers"], ["head"]], r"belong to none: 'encoder.norm.weight', 'encoder.norm.bias'"),
    ([["embed", "encoder"], ["encoder.layers.0", "head"]],
     r"belong to several: 'encoder.layers.0.self_attn.in_proj_weight'.* is in fragments \[0, 1\]"),
    ([["embed", "encoder.layer.0", "encoder"], ["head"]],
     r"'encoder.layer.0' names no module with trainable parameters .*top-level names: 'embed', 'encoder', 'head'"),
    ([["embed", "encoder.layers.1"], ["encoder.layers.10"]], r"'encoder.layers.10' names no module"),
], ids=["unassigned", "duplicated", "unknown-name", "no-prefix-match-across-a-dot"])
def test_bad_user_fragments_name_the_parameters(fragments: list, match: str) -> None:
    model = TinyLM()
    with pytest.raises(ValueError, match=match):
        fragment_assignment(model, names_of(model), LocalUpdates(2, fragments=fragments))


def test_a_module_outside_the_model_or_without_the_model_is_refused() -> None:
    model = TinyLM()
    names = names_of(model)
    config = LocalUpdates(2, fragments=[[model.embed, model.encoder], [nn.Linear(16, 32)]])
    with pytest.raises(ValueError, match="fragment 1 holds a Linear that is not a submodule of the model.*its name"):
        fragment_assignment(model, names, config)
    params = [p for _, p in trainable_parameters(model)]
    with pytest.raises(ValueError, match="fragment 0 holds a Embedding; modules are resolved to their names with the "
                                         r"model \(fragment_assignment"):
        OuterModel(names, params, LocalUpdates(2, fragments=[[model.embed, model.encoder], [model.head]]))


@pytest.mark.parametrize("kwargs,match", [
    ({"fragments": []}, r"`fragments` must be an integer >= 1 \(the number of fragments\) or a list of fragments"),
    ({"fragments": "layers"}, "or a list of fragments, each a list of module names.*got 'layers'"),
    ({"fragments": [["a"], []]}, "fragment 1 is \\[\\]"),
    ({"fragments": [["a", ""]]}, "fragment 0 holds an empty name"),
    ({"fragments": [["a", 3]]}, "fragment 0 holds 3"),
    ({"fragments": 2.0}, "`fragments` must be an integer >= 1"),
    ({"fragments": True}, "`fragments` must be an integer >= 1"),
    ({"sync_every": 4, "fragments": [["a"], ["b"], ["c"]]}, r"`sync_every` \(4\) must be a multiple of `fragments` "
                                                            r"\(3 fragments given\)"),
    ({"sync_every": 4, "fragments": [["a"], ["b"]], "delay": 2}, r"`delay` must be an integer in \[0, 1\]"),
    ({"overlap": "torchft"}, r"`overlap` must be 'after' .* or 'before' .*got 'torchft'"),
])
def test_bad_fragment_options_name_the_parameter(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LocalUpdates(**{"sync_every": 6, **kwargs})


def test_an_assignment_leaving_a_fragment_empty_is_refused() -> None:
    model = small_model()
    named = trainable_parameters(model)
    with pytest.raises(ValueError, match=r"fragment \[1\] would hold no trainable parameter"):
        OuterModel([n for n, _ in named], [p for _, p in named], LocalUpdates(6, fragments=3),
                   fragment_of=[0, 0, 2, 2, 2, 2, 0])


def test_the_fragments_parse_from_a_config() -> None:
    """LightningCLI reads ``local_updates`` with jsonargparse: fragments as lists of names, ``overlap``."""
    jsonargparse = pytest.importorskip("jsonargparse")
    from typing import Optional, Union

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--local_updates", type=Optional[Union[LocalUpdates, int]])
    config = parser.parse_args(["--local_updates", '{"sync_every": 6, "fragments": [["embed", "encoder.layers.0"], '
                                                   '["head"]], "delay": 1, "overlap": "before"}'])
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    local = instantiate(config).local_updates
    assert local == LocalUpdates(6, fragments=(("embed", "encoder.layers.0"), ("head",)), delay=1, overlap="before")


# ------------------------------------------------------------------ overlap="before": torchft's schedule
def torchft_schedule(sync_every: int, fragments: int, delay: int, steps: int) -> list[tuple[int, int, str]]:
    """torchft's ``DiLoCo._step_post_hook`` (pytorch/torchft, torchft/local_sgd.py, 2025-10), transcribed:
    ``_sync_every = H // F``; after each inner step ``_local_step += 1``; when it equals ``_sync_every −
    fragment_sync_delay`` the fragment ``manager.current_step() % F`` is prepared (its pseudo-gradient taken
    and its all-reduce started); when it equals ``_sync_every`` that fragment is synced (outer step, merge),
    the manager's step advances (a commit) and ``_local_step`` restarts. Events ``(inner step, fragment,
    "start" | "merge")``, 1-based steps."""
    per_fragment, local_step, manager_step, events = sync_every // fragments, 0, 0, []
    for step in range(1, steps + 1):
        local_step += 1
        if local_step == per_fragment - delay:
            events.append((step, manager_step % fragments, "start"))
        if local_step == per_fragment:
            events.append((step, manager_step % fragments, "merge"))
            manager_step += 1
            local_step = 0
    return events


def simulated_schedule(sync_every: int, fragments: int, delay: int, overlap: str,
                       steps: int) -> tuple[list[tuple[int, int, str]], SimulatedLocalUpdates]:
    """The schedule this package runs: the fragments whose exchange starts (``count_step``) and those whose
    global parameters moved (merged) after each inner step of two simulated workers."""
    model = small_model()
    optimizer = inner_optimizer(model)
    config = LocalUpdates(sync_every, fragments=fragments, delay=delay, alpha=0.5, overlap=overlap)
    sim = SimulatedLocalUpdates(model, [optimizer], config, workers=2, min_compress_numel=256)
    count_step = sim.outer.count_step
    started: list[int] = []

    def counting() -> list[int]:
        starting = count_step()
        started.extend(starting)
        return starting

    sim.outer.count_step = counting
    events = []
    for step in range(steps):
        before = [glob.clone() for glob in sim.outer.global_params]
        for worker in range(2):
            with sim.worker(worker):
                inner_step(model, optimizer, step, worker)
        started.clear()
        sim.step()
        moved = {sim.outer.fragment_of[i] for i, (a, b) in enumerate(zip(before, sim.outer.global_params))
                 if not torch.equal(a, b)}
        events += [(step + 1, fragment, "start") for fragment in started]
        events += [(step + 1, fragment, "merge") for fragment in sorted(moved)]
    return events, sim


def test_overlap_before_is_torchfts_schedule_step_by_step() -> None:
    """H = 6, F = 3, τ = 1, two windows: fragment f's exchange starts after step 2f + 1 of each window and
    is merged after step 2f + 2, on its boundary; every fragment is merged at the end of a window."""
    expected = [(1, 0, "start"), (2, 0, "merge"), (3, 1, "start"), (4, 1, "merge"), (5, 2, "start"), (6, 2, "merge"),
                (7, 0, "start"), (8, 0, "merge"), (9, 1, "start"), (10, 1, "merge"), (11, 2, "start"),
                (12, 2, "merge")]
    assert torchft_schedule(6, 3, 1, 12) == expected
    events, sim = simulated_schedule(6, 3, 1, "before", 12)
    assert events == expected
    assert sim.pending == []  # nothing in flight at a window's end


def test_overlap_after_is_the_paper_as_written_unchanged() -> None:
    """The default: the exchange starts on the boundary and is merged τ steps later (into the next window
    for the last fragment); torchft's events shifted by τ."""
    events, sim = simulated_schedule(6, 3, 1, "after", 12)
    assert events == [(2, 0, "start"), (3, 0, "merge"), (4, 1, "start"), (5, 1, "merge"), (6, 2, "start"),
                      (7, 2, "merge"), (8, 0, "start"), (9, 0, "merge"), (10, 1, "start"), (11, 1, "merge"),
                      (12, 2, "start")]
    assert [(step + 1, f, e) for step, f, e in torchft_schedule(6, 3, 1, 11)] == events
    assert [pending.fragment for pending in sim.pending] == [2]


@pytest.mark.parametrize("sync_every,fragments,delay", [(8, 2, 3), (6, 3, 0), (4, 1, 3), (12, 4, 2)])
def test_overlap_before_matches_torchft_for_other_schedules(sync_every: int, fragments: int, delay: int) -> None:
    events, _ = simulated_schedule(sync_every, fragments, delay, "before", 2 * sync_every + 1)
    assert events == torchft_schedule(sync_every, fragments, delay, 2 * sync_every + 1)


# ------------------------------------------------------------------ training, through the simulation
def test_the_simulation_exchanges_whole_layers() -> None:
    """``SimulatedLocalUpdates`` (and the real loop, built the same way) take their fragments from the
    module: a merge moves whole layers of one fragment."""
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sim = SimulatedLocalUpdates(model, [optimizer], LocalUpdates(4, fragments=2, delay=1, overlap="before"),
                                workers=2)
    assert sim.outer.fragment_of == fragment_assignment(model, sim.names, LocalUpdates(4, fragments=2))
    moved_after = []
    for step in range(4):
        before = [glob.clone() for glob in sim.outer.global_params]
        for worker in range(2):
            with sim.worker(worker):
                tokens = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(10 * step + worker))
                nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
                optimizer.step()
                optimizer.zero_grad()
        sim.step()
        moved_after.append(sorted({owner_module(sim.names[i]) for i, (a, b)
                                   in enumerate(zip(before, sim.outer.global_params)) if not torch.equal(a, b)}))
    assert moved_after == [[], ["embed", "encoder.layers.0", "encoder.layers.2"], [],
                           ["encoder", "encoder.layers.1", "encoder.layers.3", "head"]]


class HeadFirstLM(nn.Module):
    """LitGPT's layout: the output layer registered first (``lm_head``), then the embedding, the blocks and the
    final norm, used in the forward pass in the order embedding, blocks, norm, output layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm_head = nn.Linear(16, 32)
        self.wte = nn.Embedding(32, 16)
        self.h = nn.ModuleList([nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                                for _ in range(4)])
        self.ln_f = nn.LayerNorm(16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer, sim: SimulatedLocalUpdates) -> None:
    for worker in range(2):
        with sim.worker(worker):
            tokens = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(worker))
            nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
    sim.step()


def test_the_output_layer_goes_last_by_the_forward_pass_not_by_registration() -> None:
    """Registration order would put ``lm_head`` (registered first) with the embedding in fragment 0; the first
    forward pass shows it is used last, so the grouping settles at the first step, before any exchange, with
    the output layer and the final norm in the last fragment. A checkpoint carries it to a run that has not
    run a forward pass yet."""
    model = HeadFirstLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = LocalUpdates(4, fragments=2)
    sim = SimulatedLocalUpdates(model, [optimizer], config, workers=2)
    registration = by_fragment(sim.names, sim.outer.fragment_of)
    assert "lm_head.weight" in registration[0]  # before any forward pass: registration order
    _train_one_step(model, optimizer, sim)
    settled = by_fragment(sim.names, sim.outer.fragment_of)
    assert {"lm_head.weight", "ln_f.weight"} <= set(settled[1]) and "wte.weight" in settled[0], settled
    assert all(name.startswith(("h.0.", "h.2.", "wte.")) for name in settled[0]), settled[0]
    assert not any(module._forward_pre_hooks for module in model.modules()), "the recorder's hooks are gone"
    states = sim.state_dicts()
    for _ in range(3):
        _train_one_step(model, optimizer, sim)  # the exchanges use the settled grouping

    resumed_model = HeadFirstLM()
    resumed_optimizer = torch.optim.SGD(resumed_model.parameters(), lr=0.1)
    resumed = SimulatedLocalUpdates(resumed_model, [resumed_optimizer], config, workers=2)
    resumed.load_state_dicts(states)  # no forward pass yet: the checkpoint's grouping is taken
    assert resumed.outer.fragment_of == sim.outer.fragment_of
