"""The raw hook and ``register()`` in real gloo processes: bounded per-step state, clear refusals."""

from __future__ import annotations

import pytest

from tests._processes import run_gloo

pytestmark = pytest.mark.multiprocess


def test_the_raw_hook_keeps_no_more_than_one_step_of_figures() -> None:
    from tests._raw_hook_workers import check_the_raw_hook_keeps_one_step

    run_gloo(check_the_raw_hook_keeps_one_step, 2, 40)


def test_register_refuses_what_it_cannot_run_with_a_clear_message() -> None:
    from tests._raw_hook_workers import check_register_refuses_what_it_cannot_run

    run_gloo(check_register_refuses_what_it_cannot_run, 2)


def test_the_summary_and_counters_span_every_step_and_survive_a_resume_with_another_compressor() -> None:
    from tests._raw_hook_workers import check_summary_and_counters_span_every_step

    run_gloo(check_summary_and_counters_span_every_step, 2)


@pytest.mark.multiprocess
def test_register_refuses_a_second_hook_and_sharded_models_and_switches_compressors() -> None:
    from tests._raw_hook_workers import check_register_refuses_sharded_and_second_registrations

    run_gloo(check_register_refuses_sharded_and_second_registrations, 1)


def test_each_rank_saves_and_loads_its_own_part_of_the_exchange_state(tmp_path) -> None:
    from tests._raw_hook_workers import check_each_rank_saves_and_loads_its_own_part

    run_gloo(check_each_rank_saves_and_loads_its_own_part, 2, str(tmp_path))


def test_parts_of_a_checkpoint_are_found_beside_a_file_or_inside_a_directory_and_missing_ones_refused(tmp_path) -> None:
    """Where parts go, and what a load does without them: a checkpoint of as many ranks missing a part, or
    its whole folder, or holding a part of another save, is refused with the reason; a checkpoint of fewer
    ranks hands the ranks beyond them the first part (whose other world size then keeps the counters only);
    a link (``save_last="link"``) is read through, never written or removed through."""
    from lightning_gradcomp.exchange.checkpoint import (
        has_parts,
        load_part,
        part_file,
        parts_stub,
        remove_part,
        resolve_entry,
        save_part,
    )

    directory = tmp_path / "sharded"
    directory.mkdir()
    assert part_file(directory, 3) == directory.absolute() / "gradcomp" / "rank00003.pt"
    checkpoint = tmp_path / "one.ckpt"
    assert part_file(checkpoint, 1) == checkpoint.absolute().parent / "one.ckpt.gradcomp" / "rank00001.pt"

    def part(rank: int, step: int = 7) -> dict:
        return {"version": 1, "world_size": 2, "compressor": "TopK", "layout": "flat", "part": rank,
                "ranks": [{"step": step} if r == rank else None for r in range(2)]}

    save_part(checkpoint, 0, part(0))
    stub = parts_stub(part(0))
    assert stub == {"version": 1, "parts": 2, "world_size": 2, "compressor": "TopK", "layout": "flat", "step": 7}
    assert resolve_entry(stub, checkpoint, 0, 2) == part(0)
    with pytest.raises(FileNotFoundError, match=r"rank00001\.pt is missing: the checkpoint was written by 2 ranks"):
        resolve_entry(stub, checkpoint, 1, 2)
    assert load_part(checkpoint, 2, 3) == part(0), "a rank beyond the saved ones reads the first part"
    with pytest.raises(FileNotFoundError, match=r"one file per rank, in .*other\.ckpt\.gradcomp, which is not there"):
        resolve_entry(stub, tmp_path / "other.ckpt", 0, 2)
    save_part(checkpoint, 1, part(1, step=9))  # a later save's part over this checkpoint's
    with pytest.raises(ValueError, match=r"written at exchange step 9, the checkpoint at step 7: the parts belong to"):
        resolve_entry(stub, checkpoint, 1, 2)
    every = {"version": 1, "world_size": 2, "compressor": "TopK", "ranks": [{"step": 7}, {"step": 7}]}
    assert resolve_entry(every, checkpoint, 1, 2) is every, "an entry of every rank (older checkpoints) as it is"
    assert resolve_entry(None, checkpoint, 1, 2) is None

    link = tmp_path / "last.ckpt"
    link.symlink_to(checkpoint)
    assert has_parts(link) and part_file(link, 0) != part_file(checkpoint, 0)
    assert load_part(link, 0, 2) == part(0), "read through the link"
    remove_part(link, 0)  # ModelCheckpoint removing an old link: its target keeps its parts
    assert part_file(checkpoint, 0).is_file()
    remove_part(checkpoint, 0)
    remove_part(checkpoint, 1)
    assert not has_parts(checkpoint), "the folder goes with its last part"
