"""``gradcomp`` / ``python -m lightning_gradcomp``: LightningCLI with the gradcomp strategies registered.

Any LightningModule and LightningDataModule can be named by ``class_path`` in the YAML; the strategy can
be given as ``trainer.strategy: gradcomp`` or as a ``class_path`` with a compressor, for example::

    gradcomp fit --config recipes/quickstart_digits.yaml

``gradcomp estimate ...`` predicts, before training, whether compression pays on a given network
(:mod:`lightning_gradcomp.tools.estimate`). ``gradcomp presets`` lists the recipes and configs shipped with
the package; ``--config`` takes a recipe by its file name anywhere (:mod:`lightning_gradcomp.tools.presets`).
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_gradcomp  # noqa: F401  (registers the "gradcomp" strategies)
from lightning_gradcomp.tools.presets import describe, resolve_config


#: The commands of ``gradcomp`` besides LightningCLI's, shown under ``gradcomp --help``.
EPILOG = """more commands:
  gradcomp estimate --model M --batch-shape S ...   predict each compressor's step time on a network model
                                                    (gradcomp estimate --help)
  gradcomp presets                                  list the recipes and presets shipped with the package"""


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Build (and by default run) the command line; ``args`` replaces ``sys.argv[1:]``."""
    return LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"epilog": EPILOG, "formatter_class": argparse.RawDescriptionHelpFormatter},
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Console-script entry point (returns None, so the exit status is 0 on success).

    A bad value (a ``ValueError``) ends the run with exit status 2 and the messages that name the
    parameter, without the traceback of the argument parser; ``GRADCOMP_TRACEBACK=1`` shows it.
    """
    argv = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
    try:
        if argv[:1] == ["estimate"]:
            from lightning_gradcomp.tools.estimate import run

            run(argv[1:])
        elif argv[:1] == ["presets"]:
            print(describe())
        else:
            resolved = with_presets(argv) if not isinstance(args, dict) else argv
            build_cli(resolved if resolved != argv else args)
    except ValueError as error:
        if os.environ.get("GRADCOMP_TRACEBACK"):
            raise
        print("gradcomp: invalid configuration:", file=sys.stderr)
        for line in config_error_lines(str(error)):
            print(f"  {line}", file=sys.stderr)
        print("  (set GRADCOMP_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        raise SystemExit(2) from None


def with_presets(argv: list[str]) -> list[str]:
    """``argv`` with every ``--config``/``-c`` value that names no file replaced by the preset it names."""
    out = []
    for index, arg in enumerate(argv):
        if index and argv[index - 1] in ("--config", "-c"):
            arg = resolve_config(arg)
        elif arg.startswith("--config="):
            arg = "--config=" + resolve_config(arg.split("=", 1)[1])
        out.append(arg)
    return out


#: Lines of jsonargparse's union reports that say nothing about the value itself.
_BOILERPLATE = ("Does not validate against any", "Subtypes:", "Errors:", "Given value", "Expected a <class")


def config_error_lines(message: str) -> list[str]:
    """The lines of a (possibly nested) validation error that explain it, without duplicates."""
    lines = []
    for raw in message.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if line and not line.startswith(_BOILERPLATE) and line not in lines:
            lines.append(line)
    return lines or [message]


if __name__ == "__main__":  # pragma: no cover
    main()
