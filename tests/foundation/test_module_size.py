"""No module in the package over ~500 lines without a reason written at its top (issue 31).

A long module says why it stays one (a paragraph starting "Why it is over ~500 lines" or "Why
one module over ~500 lines" in its docstring); any other module over the limit fails here, so
the next one that grows past it is split or explained.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_hybridcache

LIMIT = 500
ROOT = Path(vllm_hybridcache.__file__).parent
MARKERS = ("Why one module over ~500 lines", "Why it is over ~500 lines")


def _long_modules() -> dict[str, str]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > LIMIT:
            out[str(path.relative_to(ROOT))] = ast.get_docstring(ast.parse(text)) or ""
    return out


def test_every_long_module_says_why_at_its_top():
    unexplained = [m for m, doc in _long_modules().items()
                   if not any(" ".join(doc.split()).count(k) for k in MARKERS)]
    assert unexplained == []


def test_the_check_sees_long_modules():
    """Negative control: the package has long modules, and a docstring without the reason
    would be reported."""
    long = _long_modules()
    assert "core/tiers/ram_tree.py" in long
    doc = long["core/tiers/ram_tree.py"].replace("Why one module", "One module")
    assert not any(doc.count(k) for k in MARKERS)
