"""No pickle on the wire or from disk: what a peer or a file sends is only ever decoded as data.

The check reads the code of every module in ``gradsync/`` token by token (docstrings and
comments may say what is avoided): no ``pickle`` module, no object collectives
(``broadcast_object_list``, ``all_gather_object``, which unpickle), no ``torch.load``.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import gradsync

FORBIDDEN_NAMES = {"pickle", "cPickle", "broadcast_object_list", "all_gather_object"}


def _uses(source: str) -> list[tuple[int, str]]:
    names = [
        t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.NAME
    ]
    found = [(t.start[0], t.string) for t in names if t.string in FORBIDDEN_NAMES]
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for a, b, c in zip(tokens, tokens[1:], tokens[2:], strict=False):
        if (a.string, b.string, c.string) == ("torch", ".", "load"):
            found.append((a.start[0], "torch.load"))
    return found


def test_the_check_sees_each_forbidden_use() -> None:
    code = "import pickle\nx = torch.load(f)\ndist.all_gather_object(a, b)\n'''pickle'''\n"
    assert [name for _, name in _uses(code)] == ["pickle", "all_gather_object", "torch.load"]


def test_no_object_collectives_pickle_or_torch_load_in_the_package() -> None:
    root = Path(gradsync.__file__).parent
    found = [
        f"{path.relative_to(root)}:{line}: {name}"
        for path in sorted(root.rglob("*.py"))
        for line, name in _uses(path.read_text())
    ]
    assert not found, "use JSON or tensors (gradsync.comm.objects) instead:\n" + "\n".join(found)
