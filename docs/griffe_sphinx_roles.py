"""A griffe extension for the API reference (mkdocs.yml): the docstrings cross-reference in Sphinx's roles,
``:class:`~pkg.Name```, ``:meth:`Handle.sync```, and write equations in ``.. math::`` blocks, which Markdown
would show as they are; this turns each role into a code span of the name it refers to (its last part when
the target starts with ``~``) and each ``.. math::`` block into a code block of its equations."""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj|math|py:\w+):`(~?)([^`]+)`")
#: ``.. math:: equation`` (or ``.. math::`` with the equations indented on the lines after it)
_MATH = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*(?P<inline>\S[^\n]*)?\n"
                   r"(?P<body>(?:(?P=indent)[ \t]+\S[^\n]*\n?|[ \t]*\n(?=(?P=indent)[ \t]+\S))*)", re.MULTILINE)


def _equations(match: re.Match) -> str:
    indent = match["indent"]
    lines = ([match["inline"]] if match["inline"] else []) + textwrap.dedent(match["body"]).strip("\n").splitlines()
    return "\n".join([f"{indent}```text", *(f"{indent}{line}" for line in lines if line.strip()), f"{indent}```", ""])


def _name(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring when griffe loads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_name, _MATH.sub(_equations, obj.docstring.value))
