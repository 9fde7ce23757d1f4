"""Formulas typeset when the site is built: TeX between `$…$` (on one line, or wrapped over several as markdown
wraps a long formula, never across a blank line) or `$$…$$` becomes MathML, which browsers draw themselves, so a
page needs no script and no network (a course site is often read offline or on a closed network).

Only text is touched: nothing inside `<pre>`, `<code>`, `<script>`, `<style>`, `<textarea>` or a tag's attributes.
A formula the converter cannot read stays visible as its TeX in `<code class="tex">`, so no formula is lost.
"""
from __future__ import annotations

import html
import re

SKIP = ("pre", "code", "script", "style", "textarea", "math")
TAG = re.compile(r"(<[^>]+>)")
DISPLAY = re.compile(r"\$\$(.+?)\$\$|\\\[(.+?)\\\]", re.S)
INLINE = re.compile(r"(?<![\\$\w])\$(?![\s$])((?:[^$\n]|\n(?![ \t]*\n))+?)(?<![\s\\])\$(?![\w$])|\\\((.+?)\\\)", re.S)


def tex_to_mathml(tex: str, display: bool) -> str:
    """One formula as MathML (`latex2mathml`), or its TeX in `<code class="tex">` when it cannot be read."""
    from latex2mathml.converter import convert
    try:
        return convert(tex.strip(), display="block" if display else "inline")
    except Exception:   # the converter's errors have no common type; the TeX stays readable
        return f'<code class="tex">{html.escape(tex)}</code>'


def _typeset_text(text: str) -> str:
    """One run of text between tags: its formulas replaced, the rest as it was."""
    def display(m):
        return tex_to_mathml(html.unescape(m.group(1) or m.group(2)), True)

    def inline(m):
        return tex_to_mathml(html.unescape(m.group(1) or m.group(2)), False)
    return INLINE.sub(inline, DISPLAY.sub(display, text))


def typeset(page: str) -> str:
    """`page` with every formula in its text as MathML. Math split across tags is not a formula of the page's
    text and is left alone."""
    out, skipping = [], []
    for part in TAG.split(page):
        if part.startswith("<") and part.endswith(">"):
            name = re.match(r"</?\s*([a-zA-Z0-9]+)", part)
            name = name.group(1).lower() if name else ""
            if name in SKIP and not part.endswith("/>"):
                if part.startswith("</"):
                    if skipping and skipping[-1] == name:
                        skipping.pop()
                else:
                    skipping.append(name)
            out.append(part)
        elif skipping or "$" not in part and "\\(" not in part and "\\[" not in part:
            out.append(part)
        else:
            out.append(_typeset_text(part))
    return "".join(out)


def raw_tex_left(text: str) -> list[str]:
    """The `$…$` formulas still in a page's visible text (what a reader would see as raw TeX)."""
    return [m.group(0) for m in INLINE.finditer(text)] + [m.group(0) for m in DISPLAY.finditer(text)]
