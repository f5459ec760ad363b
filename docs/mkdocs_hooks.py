"""MkDocs hook (mkdocs.yml ``hooks:``): the docstrings' Sphinx roles read as plain code in the API reference.

The docstrings cross-reference with reST roles (``:func:`clusterlm.select```, ``:class:`Plan```), which
mkdocstrings renders literally as ``:func:<code>...</code>``; this drops the role and keeps the code.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const|ref):(?=<code>)")


def on_page_content(html: str, **kwargs: object) -> str:
    return _ROLE.sub("", html)
