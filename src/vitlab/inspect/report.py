"""One self-contained HTML report: every figure embedded as base64 PNG (and, on request, linked to its file)."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field
from pathlib import Path

_STYLE = """
body { font-family: system-ui, -apple-system, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
img { max-width: 100%; } table { border-collapse: collapse; font-size: 0.85em; }
td, th { border: 1px solid #ccc; padding: 2px 6px; text-align: right; }
td.text, th.text { text-align: left; } .note { color: #555; font-size: 0.9em; } code { background: #f4f4f4; padding: 0 3px; }
"""


@dataclass
class Section:
    """One analysis: a title, a short explanation, optional figure and optional table."""

    title: str
    text: str = ""
    image: Path | None = None
    table: list[list[str]] | None = None  # first row = header
    notes: list[str] = field(default_factory=list)
    link: str | None = None  # a relative URL of the figure's own file, shown under the embedded copy


def _img_tag(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _is_number(value: object) -> bool:
    try:
        float(str(value))
        return True
    except ValueError:
        return False


def _table(rows: list[list[str]]) -> str:
    """Numbers right-aligned (the style's default), text columns (judged by the first row) left-aligned."""
    head, *body = rows
    first = body[0] if body else []
    text = [i < len(first) and not _is_number(first[i]) for i in range(len(head))]
    out = ["<table><tr>" + "".join(f"<th{TEXT if t else ''}>{html.escape(str(c))}</th>" for c, t in zip(head, text))
           + "</tr>"]
    for row in body:
        out.append("<tr>" + "".join(f"<td{'' if _is_number(c) else TEXT}>{html.escape(str(c))}</td>" for c in row)
                   + "</tr>")
    return "\n".join(out) + "</table>"


TEXT = " class='text'"


def write_report(path: str | Path, title: str, sections: list[Section], summary: list[str] | None = None) -> Path:
    """Write the HTML file and return its path."""
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if summary:
        parts.append("<ul>" + "".join(f"<li>{html.escape(s)}</li>" for s in summary) + "</ul>")
    for s in sections:
        parts.append(f"<h2>{html.escape(s.title)}</h2>")
        if s.text:
            parts.append(f"<p>{html.escape(s.text)}</p>")
        if s.image is not None:
            parts.append(_img_tag(s.image, s.title))
        if s.link:
            parts.append(f"<p class='note'>File: <a href=\"{html.escape(s.link)}\">{html.escape(s.link)}</a></p>")
        if s.table:
            parts.append(_table(s.table))
        for note in s.notes:
            parts.append(f"<p class='note'>{html.escape(note)}</p>")
    parts.append("</body></html>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path
