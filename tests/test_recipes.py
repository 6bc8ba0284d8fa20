"""Recipes parse, the quick-start and the LSTM recipe run, and the Penn-Treebank-layout data module."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from lightning_gradcomp.examples.language import EOS, UNK, PTBDataModule, batchify
from lightning_gradcomp.tools.cli import build_cli
from tests._processes import run_script

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_there_are_recipes_for_every_documented_workload() -> None:
    names = {r.stem for r in RECIPES}
    assert {"quickstart_digits", "cifar10_resnet18_dgc", "ptb_lstm_topk", "ptb_lstm_dgc", "ptb_lstm_qsgd",
            "fashion_mnist_adaptive"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_parses(recipe: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(recipe), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: lightning_gradcomp" in printed


def write_ptb(directory: Path, words: int = 3000, seed: int = 0) -> Path:
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(40)]
    directory.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", words), ("valid", words // 4), ("test", words // 4)):
        lines, line = [], []
        for _ in range(n):
            line.append(rng.choice(vocabulary))
            if len(line) >= rng.randint(3, 12):
                lines.append(" ".join(line))
                line = []
        (directory / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return directory


def test_ptb_data_module_maps_unknown_words_and_skips_empty_lines(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("the cat sat\n\nthe dog\n")
    (tmp_path / "valid.txt").write_text("the zebra sat\n")
    (tmp_path / "test.txt").write_text("\n\ncat\n")
    data = PTBDataModule(str(tmp_path), batch_size=1, eval_batch_size=1, bptt=2)
    data.setup("fit")
    vocab = data.vocab
    assert vocab.itos[:2] == [UNK, EOS] and len(vocab) == 2 + 4
    assert data.ids["train"].tolist() == vocab.encode(["the", "cat", "sat", EOS, "the", "dog", EOS])
    assert data.ids["valid"].tolist() == [vocab.stoi["the"], vocab.stoi[UNK], vocab.stoi["sat"], vocab.stoi[EOS]]
    assert data.ids["test"].tolist() == [vocab.stoi["cat"], vocab.stoi[EOS]]


def test_ptb_data_module_names_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("a b\n")
    (tmp_path / "valid.txt").write_text("a b\n")
    with pytest.raises(FileNotFoundError, match=r"test.txt is missing; the directory must hold train.txt, valid.txt, test.txt"):
        PTBDataModule(str(tmp_path)).setup("fit")


def test_batchify_and_bptt_chunks_shift_targets_by_one() -> None:
    from lightning_gradcomp.examples.language import BPTTChunks

    streams = batchify(torch.arange(20), 2)
    assert streams[:, 0].tolist() == list(range(10)) and streams[:, 1].tolist() == list(range(10, 20))
    chunks = BPTTChunks(streams, 4)
    assert len(chunks) == 3
    x, y = chunks[2]
    assert x[:, 0].tolist() == [8] and y[:, 0].tolist() == [9]


def _run_cli(args: list[str], cwd: Path) -> str:
    code, output = run_script("lightning_gradcomp", args, cwd, dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert code == 0, output[-4000:]
    return output


@pytest.mark.multiprocess
def test_quickstart_recipe_runs_a_fast_dev_run(tmp_path: Path) -> None:
    _run_cli(["fit", "--config", str(ROOT / "recipes/quickstart_digits.yaml"), "--trainer.fast_dev_run=true"], tmp_path)


def test_lstm_recipe_runs_a_fast_dev_run_on_tiny_local_data(tmp_path: Path, monkeypatch) -> None:
    data = write_ptb(tmp_path / "ptb")
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", "--config", str(ROOT / "recipes/ptb_lstm_topk.yaml"), "--data.data_dir", str(data),
                     "--data.batch_size", "8", "--model.init_args.hidden", "16", "--trainer.accelerator", "cpu",
                     "--trainer.fast_dev_run", "2"])
    strategy = cli.trainer.strategy
    assert strategy.workers == 4 and strategy.hook_state.step == 2
    assert sorted(k for k in cli.model.hidden if k[0] == "train") == [("train", w) for w in range(4)]
