"""``gradcomp estimate``: predictions from measured compute, measured compression and the network model."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_gradcomp.tools.cli import main
from lightning_gradcomp.tools.estimate import DEFAULT_COMPRESSORS, build_model, load_compressors, parse_bandwidth, parse_latency, run

TINY = ["--model", "mlp:64,256,256,10", "--batch-shape", "16,64", "--repeats", "1", "--threads", "1"]


def test_estimate_runs_on_a_tiny_model_and_prices_bytes_on_the_network(capsys: pytest.CaptureFixture) -> None:
    predictions = {p.name: p for p in run(TINY + ["--workers", "4", "--bandwidth", "100mbit",
                                                  "--compressors", "topk_50x", "int8_allreduce"])}
    output = capsys.readouterr().out
    assert set(predictions) == {"DDP fp32", "DDP bf16", "DDP fp16", "topk_50x", "int8_allreduce"}
    dense, half, topk = predictions["DDP fp32"], predictions["DDP bf16"], predictions["topk_50x"]
    numel = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    # plain DDP: one all-reduce per bucket (one here: under DDP's first 1 MB) and no compression cost
    assert dense.bytes_sent == 4 * numel and half.bytes_sent == 2 * numel
    assert dense.compress_s == half.compress_s == 0 and topk.compress_s > 0
    # a ring all-reduce of S bytes among 4 workers at 100 Mbit/s: 2(N-1)/N S/B plus 2(N-1) latencies
    assert dense.comm_s == pytest.approx(1.5 * 4 * numel * 8 / 100e6 + 6 * 50e-6, rel=1e-6)
    assert topk.bytes_sent < dense.bytes_sent / 20
    assert topk.step_s < dense.step_s, "at 100 Mbit/s a 50x smaller exchange is predicted faster"
    for name in predictions:
        assert f"| {name} |" in output
    assert "recommendation:" in output


def test_local_updates_price_one_exchange_every_h_steps() -> None:
    predictions = {p.name: p for p in run(TINY + ["--workers", "4", "--bandwidth", "100mbit",
                                                  "--compressors", "topk_50x", "--sync-every", "10"])}
    assert {"none, every 10 steps", "topk_50x, every 10 steps"} <= set(predictions)
    per_step, local = predictions["topk_50x"], predictions["topk_50x, every 10 steps"]
    assert local.bytes_sent == pytest.approx(per_step.bytes_sent / 10)
    assert local.comm_s == pytest.approx(per_step.comm_s / 10)
    diloco, dense = predictions["none, every 10 steps"], predictions["DDP fp32"]
    assert diloco.bytes_sent == pytest.approx(dense.bytes_sent / 10, rel=1e-3)  # fp32 (and a flag) every 10 steps
    assert local.step_s < per_step.step_s


def test_ddp_is_priced_bucket_by_bucket_as_ddp_fills_them() -> None:
    import torch

    from lightning_gradcomp.tools.estimate import ddp_exchange

    gradients = [(f"p{i}", torch.zeros(2**20)) for i in range(20)]  # 20 x 4 MiB in fp32
    exchange = ddp_exchange("DDP fp32", gradients, 4, workers=8)
    assert [nbytes for _, nbytes in exchange.collectives] == [4 * 2**20, 28 * 2**20, 28 * 2**20, 20 * 2**20]
    assert exchange.seconds == 0 and exchange.bytes_sent == 80 * 2**20


@pytest.mark.parametrize("workers", [2, 4])
def test_the_estimators_int8_bytes_are_those_step_stats_reports(workers: int) -> None:
    """The estimator counts bytes as ``step_stats`` does (the all-to-all's own chunk is not sent): int8
    comes out near its format's 3.9x against DDP fp32 at every N (counting the own chunk gave 2.6x at
    N = 2), the same bytes as a simulated run's ``step_stats``, against the same dense bytes."""
    import torch

    from lightning_gradcomp.compressors import Int8AllReduce
    from lightning_gradcomp.simulation import SimulatedExchange

    predictions = {p.name: p for p in run(TINY + ["--workers", str(workers), "--compressors", "int8_allreduce"])}
    int8, dense = predictions["int8_allreduce"], predictions["DDP fp32"]
    model = build_model("mlp:64,256,256,10")
    exchange = SimulatedExchange(Int8AllReduce(), workers)
    for worker in range(workers):
        exchange.add_worker(worker, [(name, torch.randn(p.shape)) for name, p in model.named_parameters()])
    exchange.finish_step()
    assert int8.bytes_sent == exchange.step_stats.bytes_sent and dense.bytes_sent == exchange.step_stats.bytes_dense
    assert dense.bytes_sent / int8.bytes_sent == pytest.approx(exchange.step_stats.compression_ratio)
    assert 3.8 < dense.bytes_sent / int8.bytes_sent < 3.94  # the biases (522 elements) go in fp32


def test_estimate_is_a_subcommand_of_the_gradcomp_cli(capsys: pytest.CaptureFixture) -> None:
    main(["estimate"] + TINY + ["--workers", "2", "--bandwidth", "100gbit", "--latency", "5us",
                                "--compressors", "powersgd_r2"])
    output = capsys.readouterr().out
    assert "| powersgd_r2 |" in output and "100 Gbit/s ring, 5 µs" in output


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth", "fast"], "`--bandwidth` must be a rate"),
    (["--latency", "soon"], "`--latency` must be a time"),
    (["--compressors", "gzip"], "`--compressors`: unknown preset"),
    (["--batch-shape", "16x64"], "`--batch-shape` must be comma-separated"),
    (["--sync-every", "0"], "`--sync-every` must be an integer >= 1"),
    (["--repeats", "0"], "`--repeats` must be an integer >= 1"),
    (["--threads", "0"], "`--threads` must be an integer >= 1"),
])
def test_bad_estimate_arguments_name_the_option(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    args = dict(zip(TINY[::2], TINY[1::2]))
    args.update(dict(zip(argv[::2], argv[1::2])))
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate"] + [item for pair in args.items() for item in pair])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_units_and_model_specs() -> None:
    assert parse_bandwidth("100mbit") == pytest.approx(0.1) and parse_bandwidth("25") == 25
    assert parse_latency("0.5ms") == 500 and parse_latency("50us") == 50
    model = build_model("mlp:8,4,2")
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
    assert type(build_model("torch.nn.Linear", {"in_features": 3, "out_features": 2})).__name__ == "Linear"
    with pytest.raises(ValueError, match="`--model`: cannot import"):
        build_model("no_such_package.Model")


def test_every_shipped_compressor_preset_can_be_estimated() -> None:
    """``all`` is every preset in configs/compressors (but the uncompressed ones, priced as DDP's rows), found
    where ``gradcomp presets`` finds them; the default is a representative set of them."""
    shipped = {path.stem for path in (Path(__file__).resolve().parents[1] / "configs" / "compressors").glob("*.yaml")}
    assert set(load_compressors(["all"])) == shipped - {"none", "fp16"}
    assert set(load_compressors()) == set(DEFAULT_COMPRESSORS) < shipped
    assert set(load_compressors(["qsgd_s16", "demo"])) == {"qsgd_s16", "demo"}


class TinyConfig:
    """A config object, as LitGPT's ``Config``: the model takes it, not numbers."""

    def __init__(self, vocab: int = 50, width: int = 8) -> None:
        self.vocab, self.width = vocab, width


class TinyGPT(__import__("torch").nn.Module):
    def __init__(self, config: TinyConfig) -> None:
        import torch

        super().__init__()
        self.embed = torch.nn.Embedding(config.vocab, config.width)
        self.head = torch.nn.Linear(config.width, config.vocab)

    def forward(self, tokens):  # noqa: ANN001, ANN201
        return self.head(self.embed(tokens))


def make_tiny_gpt(vocab: int = 50) -> TinyGPT:
    return TinyGPT(TinyConfig(vocab))


@pytest.mark.parametrize("model, model_args", [("tests.test_estimate:TinyGPT", '{"config": {"vocab": 40}}'),
                                               ("tests.test_estimate:make_tiny_gpt", '{"vocab": 30}')])
def test_a_model_built_from_a_config_or_a_factory_draws_tokens_its_embedding_holds(model: str, model_args: str) -> None:
    """A JSON object for an argument annotated with a class builds that class (LitGPT's ``GPT(config: Config)``),
    a factory function is called, and integer inputs come from the model's smallest vocabulary (a range of
    10,000 made a 40-token embedding fail with IndexError)."""
    predictions = run(["--model", model, "--model-args", model_args, "--batch-shape", "2,6", "--input-dtype", "int64",
                       "--repeats", "1", "--threads", "1", "--compressors", "int8_allreduce"])
    assert {p.name for p in predictions} >= {"DDP fp32", "int8_allreduce"}
    assert build_model("tests.test_estimate:TinyGPT", {"config": {"vocab": 40}}).embed.num_embeddings == 40
