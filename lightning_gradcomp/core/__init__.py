"""The bottom layer: what every other layer uses, importing nothing of the package (docs/architecture.md)."""
