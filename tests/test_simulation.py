"""The single-device simulation of N workers: per-worker memory, hidden states, equality with real DDP."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.compressors import CompressContext, HardThreshold, TopK
from lightning_gradcomp.simulation import DistributedOrderBatchSampler, GradCompSimStrategy, SimulatedExchange, current_worker
from tests._processes import STEPS_PER_EPOCH


def test_the_simulated_exchange_offers_the_declared_contract() -> None:
    from lightning_gradcomp.exchange.state import ExchangeState

    assert isinstance(SimulatedExchange(TopK(0.1), workers=2), ExchangeState)


def test_each_worker_has_its_own_residual_and_each_obeys_the_invariant() -> None:
    compressor = TopK(0.1)
    exchange = SimulatedExchange(compressor, workers=3, min_compress_numel=10)
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        grads = [torch.randn(200, generator=generator) for _ in range(3)]
        previous = [p.memory.residuals.get("w", torch.zeros(200)).clone() for p in exchange.pipelines]
        for worker, grad in enumerate(grads):
            exchange.add_worker(worker, [("w", grad)])
        aggregate = exchange.finish_step()["w"]
        expected = torch.zeros(200)
        for worker, grad in enumerate(grads):
            p = grad + previous[worker]
            sent = compressor.decompress(compressor.compress(p, CompressContext("w", step, worker, 3)))
            residual = exchange.pipelines[worker].memory.residuals["w"]
            assert torch.equal(sent + residual, p)
            expected.add_(sent, alpha=1 / 3)
        torch.testing.assert_close(aggregate, expected)
    r = [p.memory.residuals["w"] for p in exchange.pipelines]
    assert not torch.equal(r[0], r[1]) and not torch.equal(r[1], r[2])
    assert exchange.step_stats.density == pytest.approx(0.1)
    # 20 values + 20 int32 indices per worker, and the 4-byte finiteness flag (the buffer aligned to 8)
    assert exchange.step_stats.bytes_sent == 20 * 8 + 8


def test_data_dependent_sizes_count_the_header_and_the_largest_worker() -> None:
    exchange = SimulatedExchange(HardThreshold(1.0), workers=2, min_compress_numel=10)
    exchange.add_worker(0, [("w", torch.tensor([5.0] * 10 + [0.0] * 10))])
    exchange.add_worker(1, [("w", torch.tensor([5.0] * 2 + [0.0] * 18))])
    exchange.finish_step()
    stats = exchange.step_stats
    # count header, then the payloads padded to the largest worker, with the finiteness flag (aligned to 8)
    assert stats.collectives == [("all_gather", 4), ("all_gather", 88)]
    assert stats.bytes_sent == 92 and stats.elements_sent == 6


def test_distributed_order_batches_interleave_the_ranks() -> None:
    from torch.utils.data import DistributedSampler

    dataset = list(range(23))
    sampler = DistributedOrderBatchSampler(dataset, workers=2, batch_size=4, shuffle=True, seed=3)
    sampler.set_epoch(1)
    ranks = []
    for rank in range(2):
        s = DistributedSampler(dataset, 2, rank, shuffle=True, seed=3)
        s.set_epoch(1)
        ranks.append(list(s))
    batches = list(sampler)
    assert len(batches) == len(sampler) == 3
    assert batches[0] == ranks[0][:4] + ranks[1][:4]
    assert batches[2] == ranks[0][8:] + ranks[1][8:]


class TinyLSTM(L.LightningModule):
    """Keeps one hidden state per simulated worker, as Harris 2020's Algorithm 1 does."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8)
        self.head = nn.Linear(8, 4)
        self.hidden: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.seen_workers: list[int] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch  # (seq, batch, features): the strategy splits dim 1
        worker = current_worker(self)
        self.seen_workers.append(worker)
        state = self.hidden.get(worker)
        out, (h, c) = self.lstm(x, state)
        self.hidden[worker] = (h.detach(), c.detach())
        return self.head(out).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_four_simulated_workers_keep_four_distinct_hidden_states() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(3, 5, 8, 4))  # 3 batches of (seq 5, batch 8, features 4)
    loader = DataLoader(data, batch_size=None)
    model = TinyLSTM()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=GradCompSimStrategy(workers=4, compressor="none", batch_dim=1))
    trainer.fit(model, loader)
    assert model.seen_workers == [0, 1, 2, 3] * 3
    assert sorted(model.hidden) == [0, 1, 2, 3]
    hidden = [model.hidden[w][0] for w in range(4)]
    assert all(h.shape == (1, 2, 8) for h in hidden)
    assert all(not torch.equal(hidden[i], hidden[j]) for i in range(4) for j in range(i + 1, 4))
    assert trainer.strategy.hook_state.step == 3


def test_a_batch_that_does_not_split_evenly_is_refused() -> None:
    data = TensorDataset(torch.randn(10, 4, 4))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=GradCompSimStrategy(workers=3, compressor="none", batch_dim=1,
                                                     uneven_batches="error"))
    with pytest.raises(ValueError, match="a batch of 4 samples cannot be split equally among 3 workers"):
        trainer.fit(TinyLSTM(), DataLoader(data, batch_size=None))


def test_simulation_is_reachable_by_name_and_from_the_strategy() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="gradcomp_sim", logger=False)
    assert isinstance(trainer.strategy, GradCompSimStrategy) and trainer.strategy.workers == 4
    strategy = GradCompStrategy.simulated(workers=8, compressor=TopK(density=0.001))
    assert isinstance(strategy, GradCompSimStrategy) and strategy.workers == 8
    assert strategy.compressor.density == 0.001
    with pytest.raises(ValueError, match="`workers` must be an integer >= 1"):
        GradCompSimStrategy(workers=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("compressor", ["topk", "none", "powersgd"])
def test_simulated_run_equals_a_real_two_process_run(lightning_runs, compressor: str) -> None:
    real, _ = lightning_runs(f"real3_{compressor}", "--compressor", compressor, "--epochs", "3")
    simulated, _ = lightning_runs(f"sim3_{compressor}", "--compressor", compressor, "--epochs", "3", "--simulate", "2")
    assert simulated[0]["global_step"] == real[0]["global_step"] == 3 * STEPS_PER_EPOCH
    for key, value in real[0]["params"].items():
        torch.testing.assert_close(simulated[0]["params"][key], value, rtol=1e-5, atol=1e-6)
    assert simulated[0]["totals"]["bytes_sent"] == real[0]["totals"]["bytes_sent"], "one engine: the same bytes"
    if compressor != "none":
        real_norms = sorted(r["residual_norm"] for r in real)
        assert sorted(simulated[0]["residual_norms"]) == pytest.approx(real_norms, rel=1e-3)


@pytest.mark.multiprocess
def test_callbacks_work_unchanged_with_the_simulation(lightning_runs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = lightning_runs.root / "tb_sim"
    runs, _ = lightning_runs("sim_callbacks", "--compressor", "dgc", "--epochs", "3", "--simulate", "2",
                             "--warmup-epochs", "2", "--monitor", "--tensorboard", str(board))
    per_epoch = {}
    for step in runs[0]["steps"]:
        per_epoch.setdefault(step["epoch"], set()).add(step["compressor_density"])
    assert [per_epoch[e] for e in range(3)] == [{0.25}, {0.0625}, {0.001}]
    (event_file,) = board.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(event_file))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("total_error", "comm_ms_est", "average_density", "compress_ms", "bytes_sent_total",
                "epoch_compute_s", "epoch_comm_s_est", "epoch_total_s_est"):
        assert f"gradcomp/{tag}" in tags, tag
    assert all(e.value > 0 for e in events.Scalars("gradcomp/comm_ms_est"))


def _sim_fit(tmp_path, epochs: int, ckpt_in=None, ckpt_out=None, workers: int = 2, compressor=None,
             momentum: float = 0.0, save_at_epoch=None, **trainer_kwargs):
    """A simulated digits fit (``trainer_kwargs`` also reach the strategy: ``local_updates=``); ``ckpt_out``
    is written after ``fit``, or at the end of epoch ``save_at_epoch`` (counted from 1) of a fit that goes
    on (the checkpoint a job stopped there leaves)."""
    from lightning_gradcomp.examples.digits import DigitsClassifier, DigitsDataModule

    class EpochSeededDigits(DigitsDataModule):  # the order of epoch e depends on (seed, e) only
        def train_dataloader(self):
            return DataLoader(self.train_set, batch_sampler=DistributedOrderBatchSampler(self.train_set, 2, 32, seed=3))

    L.seed_everything(3, verbose=False)
    model = DigitsClassifier(hidden=64, momentum=momentum)
    strategy = GradCompSimStrategy(workers=workers, compressor=compressor or TopK(0.02),
                                   local_updates=trainer_kwargs.pop("local_updates", None))
    class SaveAtEpochEnd(L.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            if trainer.current_epoch + 1 == save_at_epoch:
                trainer.save_checkpoint(ckpt_out)

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, deterministic=True, default_root_dir=tmp_path,
                        callbacks=[SaveAtEpochEnd()] if save_at_epoch else [], **trainer_kwargs)
    trainer.fit(model, datamodule=EpochSeededDigits(batch_size=32), ckpt_path=ckpt_in)
    if ckpt_out and not save_at_epoch:
        trainer.save_checkpoint(ckpt_out)
    return model, strategy


def test_simulated_run_resumes_with_every_workers_memory(tmp_path) -> None:
    whole, whole_strategy = _sim_fit(tmp_path, 2)
    ckpt = tmp_path / "half.ckpt"
    _sim_fit(tmp_path, 1, ckpt_out=ckpt)
    saved = torch.load(ckpt, weights_only=True)["gradcomp"]
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    resumed, resumed_strategy = _sim_fit(tmp_path, 2, ckpt_in=ckpt)
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    for a, b in zip(whole_strategy.hook_state.pipelines, resumed_strategy.hook_state.pipelines):
        assert torch.equal(a.memory.residuals["net.0.weight"], b.memory.residuals["net.0.weight"])
    assert whole_strategy.hook_state.totals == resumed_strategy.hook_state.totals


def test_resume_with_another_worker_count_says_what_is_dropped_and_kept(tmp_path) -> None:
    from lightning_gradcomp.compressors import DGC

    ckpt = tmp_path / "dgc.ckpt"
    _, first = _sim_fit(tmp_path, 1, ckpt_out=ckpt, compressor=DGC(0.05, momentum=0.0))
    steps = first.hook_state.step
    with pytest.warns(UserWarning) as caught:
        _, resumed = _sim_fit(tmp_path, 2, ckpt_in=ckpt, workers=3, compressor=DGC(0.05, momentum=0.0))
    message = next(str(w.message) for w in caught if "gradcomp" in str(w.message))
    assert "holds error-feedback memory of 2 workers of DGC, this run has 3 of DGC" in message
    assert "Dropped: every worker's error-feedback residuals and compressor state (momentum, velocity)" in message
    assert f"Kept: the step counter ({steps}, so random draws do not repeat)" in message
    assert resumed.hook_state.step == 2 * steps, "the step counter went on from the checkpoint"
