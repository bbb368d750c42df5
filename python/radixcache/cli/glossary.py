"""``radixcache glossary``: print what each row of the reports means (docs/glossary.md)."""

from __future__ import annotations

import argparse

from ..glossary import markdown
from .report import _emit


def _glossary_cmd(args: argparse.Namespace) -> int:
    _emit(markdown().rstrip("\n"))
    return 0
