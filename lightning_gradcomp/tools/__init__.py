"""Command-line tools: ``gradcomp fit/validate/test`` (LightningCLI) and ``gradcomp estimate``."""
