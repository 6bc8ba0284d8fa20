"""``gradcomp`` / ``python -m lightning_gradcomp``: LightningCLI with the gradcomp strategies registered.

Any LightningModule and LightningDataModule can be named by ``class_path`` in the YAML; the strategy can
be given as ``trainer.strategy: gradcomp`` or as a ``class_path`` with a compressor, for example::

    gradcomp fit --config recipes/quickstart_digits.yaml
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_gradcomp  # noqa: F401  (registers the "gradcomp" strategies)


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Build (and by default run) the command line; ``args`` replaces ``sys.argv[1:]``."""
    return LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Console-script entry point (returns None, so the exit status is 0 on success)."""
    build_cli(args)


if __name__ == "__main__":  # pragma: no cover
    main()
