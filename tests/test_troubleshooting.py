"""docs/troubleshooting.md cannot drift from the code.

* Every exception class the package defines (found by importing every module of ``lightning_gradcomp``,
  the Lightning ones included) is named in a heading of the page.
* Every message fragment the page quotes (each code span on a line starting with ``**Message:**``)
  occurs verbatim in the package's source: in a string literal, or in the literal text of an f-string
  between its ``{...}`` fields, whitespace runs counting as one space. The string pieces are read with
  ``ast``, so implicit concatenation across source lines is already joined; ``"a" + f"b{x}"`` is joined too.
* Every parameter named in the first column of a "Parameter" table is one the source names (the string
  ``"name"`` given to a check, or ``"`name`"`` inside a message).

The page's format is described in an HTML comment at its top.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import lightning_gradcomp

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"
PACKAGE = Path(lightning_gradcomp.__file__).resolve().parent
MARKER = "**Message:**"

# A CommonMark code span: a run of N backticks, content, the next run of exactly N backticks.
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")


def normalise(text: str) -> str:
    return " ".join(text.split())


def code_spans(text: str) -> list[str]:
    """The contents of the code spans in ``text``, as Markdown renders them (one space stripped at each end
    when both ends have one: how ``` `` `x` `` ``` shows a backtick at its edge)."""
    spans = []
    for match in CODE_SPAN.finditer(text):
        content = match.group(2)
        if len(content) >= 2 and content[0] == " " and content[-1] == " " and content.strip():
            content = content[1:-1]
        spans.append(content)
    return spans


@functools.lru_cache(maxsize=None)
def page_lines() -> tuple[str, ...]:
    """The page's lines, blank inside HTML comments and fenced code blocks (line ``i`` is the file's line
    ``i + 1``)."""
    text = re.sub(r"<!--.*?-->", lambda comment: "\n" * comment.group().count("\n"),
                  PAGE.read_text(encoding="utf-8"), flags=re.S)  # the same line numbers
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            line = ""
        lines.append("" if fenced else line)
    return tuple(lines)


def _literal_runs(node: ast.AST) -> list[str]:
    """The literal text of a string expression (a constant, an f-string, a ``+`` of them) as runs, each
    ended by a formatted field; ``[]`` for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        runs = [""]
        for value in node.values:
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                runs[-1] += value.value
            else:
                runs.append("")
        return runs
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_runs(node.left), _literal_runs(node.right)
        if left and right:
            return [*left[:-1], left[-1] + right[0], *right[1:]]
        return left + right
    return []


@functools.lru_cache(maxsize=None)
def source_strings() -> tuple[str, frozenset[str]]:
    """Every literal run of the package's source, normalised and joined by NUL (one string to search), and
    the set of its plain string constants."""
    runs: list[str] = []
    constants: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                constants.add(node.value)
            runs.extend(normalise(run) for run in _literal_runs(node))
    return "\0".join(runs), frozenset(constants)


def quoted_fragments() -> list[tuple[int, str]]:
    """``(line number, fragment)`` of every fragment the page quotes as a message."""
    fragments = []
    for number, line in enumerate(page_lines(), 1):
        if line.startswith(MARKER):
            spans = code_spans(line[len(MARKER):])
            assert spans, f"a {MARKER} line quotes nothing: {line!r}"
            fragments.extend((number, span) for span in spans)
    return fragments


def exception_classes() -> dict[str, type]:
    """Every exception class defined in a module of the package (the Lightning modules included; the
    ``__main__`` module is skipped: importing it runs the command line)."""
    found = {}
    modules = [lightning_gradcomp] + [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(lightning_gradcomp.__path__, "lightning_gradcomp.")
        if info.name.rsplit(".", 1)[-1] != "__main__"
    ]
    for module in modules:
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_every_exception_class_has_an_entry():
    classes = exception_classes()
    assert "lightning_gradcomp.exchange.agreement.SettingsMismatch" in classes, "the module walk found too little"
    headings = "\n".join(line for line in page_lines() if line.startswith("#"))
    missing = sorted(path for path, cls in classes.items() if not re.search(rf"\b{cls.__name__}\b", headings))
    assert not missing, f"exception classes without an entry (a heading) in {PAGE.name}: {missing}"


def test_quoted_messages_occur_in_the_source():
    text, _ = source_strings()
    fragments = quoted_fragments()
    assert len(fragments) > 100, f"only {len(fragments)} quoted fragments: is the {MARKER} format still used?"
    missing = [f"line {number}: {fragment!r}" for number, fragment in fragments
               if normalise(fragment) not in text]
    assert not missing, (f"{PAGE.name} quotes message text that the package's source no longer holds "
                         "(reword the entry after the message):\n" + "\n".join(missing))


def test_tabled_parameters_occur_in_the_source():
    text, constants = source_strings()
    names, lines = [], page_lines()
    for index, line in enumerate(lines):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] != "Parameter":
            continue
        for row in lines[index + 2:]:  # after the header and its |---| line
            if not row.startswith("|"):
                break
            names.extend(code_spans(row.strip().strip("|").split("|")[0]))
    assert len(names) > 50, f"only {len(names)} parameters found in the tables of {PAGE.name}"
    missing = sorted({name for name in names if name not in constants and f"`{name}`" not in text})
    assert not missing, f"parameters in {PAGE.name}'s tables that the source does not name: {missing}"
