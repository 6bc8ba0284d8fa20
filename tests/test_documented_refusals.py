"""What the documentation (README.md and the pages of docs/) says is refused is refused, and what it says works
is accepted.

Every list a page opens with "Refused, with the reason:" is split into its items, and each item must be
in :data:`REFUSALS` (under the page and section that hold the list) with the check that backs it: a call here
that must raise, or a multi-process worker (``file::function``) whose source expects the refusal's message
and which a test runs. A refusal added to the documentation without a check fails here; a documented refusal that
the code accepts fails here or in its worker's test. :data:`FEATURES` does the same for statements that
something is supported (each once said "refused" or "not yet" while it worked).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any, Callable, Union

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _documentation() -> str:
    """Every page without its code blocks, each heading prefixed by its page's path (``docs/sharded.md: ## ...``)."""
    pages = []
    for path in PAGES:
        prose = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
        pages.append(re.sub(r"^(#{1,4} .*)$", lambda m, p=path: f"{_page_name(p)}: {m.group(1)}", prose, flags=re.M))
    return "\n".join(pages)


#: a check: a callable that must raise ``ValueError`` matching the pattern, or a worker and its expected phrases
Check = Union[tuple[Callable[[], Any], str], tuple[str, tuple[str, ...]]]


def _fsdp_strategy(**kwargs: Any) -> Any:
    from lightning_gradcomp.lightning.fsdp_strategy import GradCompFSDPStrategy

    return GradCompFSDPStrategy(**kwargs)


def _fsdp_trainer_16_mixed() -> Any:
    import lightning as L

    return L.Trainer(strategy=_fsdp_strategy(), precision="16-mixed", accelerator="cpu", devices=1, logger=False)


def _fault_tolerance() -> Any:
    from lightning_gradcomp import FaultTolerance

    return FaultTolerance(lighthouse="http://127.0.0.1:29510")


#: page: section -> refusal listed there -> its checks
REFUSALS: dict[str, dict[str, list[Check]]] = {
    "docs/sharded.md: ## Sharded models under the Trainer: `GradCompFSDPStrategy`": {
        "`hierarchy`": [(lambda: _fsdp_strategy(hierarchy="node"), r"`hierarchy='node'`: the mesh is the hierarchy")],
        "`exchange_thread`": [(lambda: _fsdp_strategy(exchange_thread=True), r"`exchange_thread=True`")],
        "`data_parallel_size` / `tensor_parallel_size` and `DistributedDataParallel`'s arguments": [
            (lambda: _fsdp_strategy(data_parallel_size=2), r"`data_parallel_size=2`: the mesh is"),
            (lambda: _fsdp_strategy(tensor_parallel_size=2), r"`tensor_parallel_size=2`: tensor parallelism"),
            (lambda: _fsdp_strategy(find_unused_parameters=True), r"DistributedDataParallel's arguments do not apply"),
        ],
        '`precision="16-mixed"` (Lightning refuses it for FSDP2)': [(_fsdp_trainer_16_mixed, r"precision='16-mixed'")],
    },
    "docs/sharded.md: ## Plain PyTorch: `register_fsdp`": {
        "a gradient divide factor (`set_gradient_divide_factor`)": [
            ("tests/_fsdp_workers.py::check_steps_settings_and_mesh_changes", ("gradient divide factor",))],
        "`set_requires_all_reduce(False)` (use `set_requires_gradient_sync(False)` to accumulate)": [
            ("tests/_fsdp_workers.py::check_steps_settings_and_mesh_changes", ("set_requires_gradient_sync",))],
        "compiled autograd": [
            ("tests/_fsdp_workers.py::check_bad_meshes_and_modules_are_refused",
             ("does not run under compiled autograd",))],
        "modules sharded on a 2-D mesh (native HSDP) or with several parameter groups": [
            ("tests/_fsdp_workers.py::check_bad_meshes_and_modules_are_refused",
             ("native HSDP", "has 2 parameter groups"))],
        "trainable parameters no `fully_shard` covers": [
            ("tests/_fsdp_workers.py::check_steps_settings_and_mesh_changes", ("are not sharded",))],
    },
    "docs/sharded.md: ## Local updates on sharded models (FSDP2)": {
        "a sharded model without `mesh=`": [
            ("tests/_fsdp_local_workers.py::check_resume_views_sync_and_refusals", ("pass the 2-D mesh",))],
        "`group=` with a mesh": [
            ("tests/_fsdp_local_workers.py::check_resume_views_sync_and_refusals", ("mesh=mesh, group=dist.group.WORLD",))],
        "modules on a 2-D mesh (native HSDP)": [
            ("tests/_fsdp_local_workers.py::check_resume_views_sync_and_refusals", ("native HSDP",))],
        "trainable parameters no `fully_shard` covers": [
            ("tests/_fsdp_local_workers.py::check_resume_views_sync_and_refusals", ("not sharded by any fully_shard",))],
    },
}

#: statements of the documentation that something is supported -> a call that must be accepted, or the test that runs it
FEATURES: dict[str, Union[Callable[[], Any], str]] = {
    "- **Local updates** on the shards: `local_updates=`, `global_device=`, `fault_tolerance=`":
        lambda: _fsdp_strategy(local_updates=2, global_device="cpu", fault_tolerance=_fault_tolerance()),
    '`global_device="cpu"` (with `local_updates=`, in `GradCompStrategy`, `GradCompFabricStrategy` and '
    '`GradCompFSDPStrategy`) keeps `θ_global`': lambda: [
        getattr(__import__("lightning_gradcomp"), name)(local_updates=2, global_device="cpu")
        for name in ("GradCompStrategy", "GradCompFabricStrategy", "GradCompFSDPStrategy")],
    "## Fabric: `GradCompFabricFSDPStrategy` (`\"gradcomp_fsdp\"`)": lambda: __import__("lightning.fabric").fabric.Fabric(
        strategy="gradcomp_fsdp", accelerator="cpu", devices=2),
    "Fault tolerance on shards: each replica group is one job sharded over its own world":
        "tests/test_torchft_diloco.py::test_fault_tolerant_replica_groups_of_fsdp2_shards_equal_the_mesh",
}


def refusal_lists(text: str) -> dict[str, list[str]]:
    """Each section's "Refused, with the reason:" list, split into its items (headings as :func:`_documentation`
    writes them)."""
    found: dict[str, list[str]] = {}
    heading = ""
    sections = re.split(r"^(\S+\.md: #{1,4} .*)$", text, flags=re.M)
    for part in sections:
        if re.match(r"\S+\.md: #{1,4} ", part):
            heading = part.strip()
            continue
        for match in re.finditer(r"Refused\**, with the reason: (.*?)(?:\.\s|\.$)", part, re.S):
            items = [" ".join(item.split()) for item in re.split(r",\s+|;\s+", match.group(1))]
            found.setdefault(heading, []).extend(item for item in items if item)
    return found


def test_every_documented_refusal_has_a_check_and_every_check_a_documented_refusal() -> None:
    lists = refusal_lists(_documentation())
    assert lists, "the documentation lists no refusals: this test reads its 'Refused, with the reason:' lists"
    for heading, items in lists.items():
        assert heading in REFUSALS, f"section {heading!r} lists refusals with no checks here: {items}"
        missing = [item for item in items if item not in REFUSALS[heading]]
        assert not missing, f"{heading}: refusals without a check in tests/test_documented_refusals.py: {missing}"
    for heading, checks in REFUSALS.items():
        stale = [item for item in checks if item not in lists.get(heading, [])]
        assert not stale, f"{heading}: checks of refusals the documentation no longer lists: {stale}"


_CALLS = [(heading, item, check) for heading, items in REFUSALS.items() for item, checks in items.items()
          for check in checks if callable(check[0])]
_WORKERS = [(heading, item, check) for heading, items in REFUSALS.items() for item, checks in items.items()
            for check in checks if isinstance(check[0], str)]


@pytest.mark.parametrize("heading, item, check", _CALLS, ids=[f"{item[:40]}" for _, item, _ in _CALLS])
def test_a_documented_refusal_raises(heading: str, item: str, check: Any) -> None:
    call, pattern = check
    with pytest.raises(ValueError, match=pattern):
        call()


def _function_source(path: Path, name: str) -> str:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(path.read_text(), node) or ""
    raise AssertionError(f"{path.name} has no function {name}")


def test_a_documented_refusal_checked_in_real_processes_is_expected_by_a_worker_that_a_test_runs() -> None:
    tests = "\n".join(path.read_text() for path in (ROOT / "tests").glob("test_*.py"))
    for heading, item, (where, phrases) in _WORKERS:
        file, function = where.split("::")
        source = _function_source(ROOT / file, function)
        absent = [phrase for phrase in phrases if phrase not in source]
        assert not absent, f"{heading}: {item!r}: {where} does not expect {absent}"
        assert re.search(rf"\b{function}\b", tests), f"no test runs {where} ({item!r})"


@pytest.mark.parametrize("statement", list(FEATURES), ids=[statement[:40] for statement in FEATURES])
def test_a_documented_feature_is_accepted(statement: str) -> None:
    text = " ".join(" ".join(path.read_text().split()) for path in PAGES)
    assert statement in text, f"the documentation no longer says: {statement!r}"
    check = FEATURES[statement]
    if isinstance(check, str):  # run by that test (multi-process): it must exist
        file, function = check.split("::")
        _function_source(ROOT / file, function)
    else:
        check()
