"""The documentation's Python code blocks (README.md, docs/) are tests: see tests/_docs.py."""

from pathlib import Path

from tests._docs import collector

pytest_collect_file = collector(Path(__file__).parent)
