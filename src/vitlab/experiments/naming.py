"""Folder names for the studies' model entries (compare, study scaling, study transfer): one rule for all three.

A readable slug of the entry ('custom(dim=32)' -> 'custom-dim-32'). A slug can lose what tells two entries
apart: cut to `LIMIT` characters, two long specs that differ only at the end got one folder and one study
silently reused the other's results. Such a slug gets a short hash of the whole entry appended. Slugs that
fit stay as they always were, so existing studies resume into their folders.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from vitlab.errors import VitlabError

LIMIT = 60  # characters of a folder name (the slug's old cut)
_HASH = 8  # hex digits of the appended hash: a collision by chance would need ~65 k long specs


def _slug(name: str, collapse: bool) -> str:
    out = "".join(c if c.isalnum() or c in "-_" else "-" for c in name)
    while collapse and "--" in out:
        out = out.replace("--", "-")
    return out.strip("-")


def folder_name(name: str, *, collapse: bool = False) -> str:
    """The folder of entry `name`: its slug, or a cut slug + '-' + a hash of the whole name where the slug is
    too long or empty. `collapse` joins runs of '-' (compare's folders always did; the studies' did not)."""
    slug = _slug(name, collapse)
    if slug and len(slug) <= LIMIT:
        return slug
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:_HASH]
    head = slug[: LIMIT - _HASH - 1].rstrip("-") or "model"
    return f"{head}-{digest}"


def check_distinct(names: Iterable[str], flag: str = "--models", *, collapse: bool = False) -> None:
    """Refuse two entries that would share a folder (also on a case-insensitive file system): one would
    read or overwrite the other's runs. Short slugs keep their old names, so only these clashes remain."""
    seen: dict[str, str] = {}
    for name in names:
        key = folder_name(name, collapse=collapse).lower()
        if key in seen and seen[key] != name:
            raise VitlabError(f"{flag} entries {seen[key]!r} and {name!r} would share the folder "
                              f"{folder_name(name, collapse=collapse)!r}; write one of them differently")
        seen.setdefault(key, name)
