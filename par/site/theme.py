"""The frame and the style of every page: a header with the course's sections, where the numbers came from, the
page, and the same provenance line at the foot. One stylesheet (`style.css`), no script: formulas are MathML,
typeset when the site is built (`par.site.mathml`), unless a MathJax script is named (`--mathjax URL`); cells come from nbconvert's `basic` template (classes `cell`, `input_area`,
`output_area`, `rendered_html`) and code is coloured by Pygments' classes.
"""
from __future__ import annotations

from html import escape

from pygments.formatters import HtmlFormatter

from par.site import mathml

SITE_NAME = "par — parallel training, run for real"

# No MathJax by default: the site is read offline too. A MathJax 3 script named by `--mathjax URL` typesets the
# TeX (between $...$ or $$...$$, as JupyterLab shows it) in the reader's browser instead, on pages with formulas.
MATHJAX_URL = None
MATHJAX_CONFIG = ("window.MathJax = {tex: {inlineMath: [['$', '$'], ['\\\\(', '\\\\)']], processEscapes: true}, "
                  "options: {skipHtmlTags: ['script', 'noscript', 'style', 'textarea', 'pre', 'code']}};")

CSS = """
math { font-size: 1.15em; }
code.tex { color: #8a1c1c; }
:root { --fg: #1f2328; --muted: #59636e; --line: #d1d9e0; --bg-soft: #f6f8fa; --accent: #0b5cad;
        --ok: #1a7f37; --bad: #cf222e; --warn: #9a6700; }
* { box-sizing: border-box; }
html { -webkit-text-size-adjust: 100%; }
body { margin: 0; color: var(--fg); background: #fff; line-height: 1.55;
       font: 16px/1.55 -apple-system, "Segoe UI", "Noto Sans", Helvetica, Arial, sans-serif; }
a { color: var(--accent); text-decoration: none; }
a:hover { text-decoration: underline; }
header.site { border-bottom: 1px solid var(--line); background: var(--bg-soft); }
header.site .bar { max-width: 62rem; margin: 0 auto; padding: .6rem 1.25rem; display: flex; flex-wrap: wrap;
                   align-items: baseline; gap: .4rem 1.2rem; }
header.site .name { font-weight: 700; color: var(--fg); margin-right: auto; }
header.site nav a { margin-left: 1rem; font-size: .95rem; }
header.site nav a.here { color: var(--fg); font-weight: 600; }
main { max-width: 62rem; margin: 0 auto; padding: 1rem 1.25rem 3rem; }
.provenance { font-size: .85rem; color: var(--muted); border: 1px solid var(--line); border-radius: 6px;
              padding: .45rem .75rem; margin: .5rem 0 1.25rem; background: #fff; }
.provenance b { color: var(--fg); font-weight: 600; }
footer.site { max-width: 62rem; margin: 0 auto; padding: 1rem 1.25rem 2rem; color: var(--muted);
              font-size: .85rem; border-top: 1px solid var(--line); }
h1, h2, h3, h4 { line-height: 1.25; margin: 1.6em 0 .6em; }
h1 { font-size: 1.9rem; margin-top: .6em; }
h2 { font-size: 1.45rem; border-bottom: 1px solid var(--line); padding-bottom: .25em; }
h3 { font-size: 1.15rem; }
p, ul, ol { margin: .6em 0; }
code, pre, kbd { font-family: ui-monospace, SFMono-Regular, "DejaVu Sans Mono", Menlo, Consolas, monospace;
                 font-size: .86em; }
:not(pre) > code { background: var(--bg-soft); padding: .1em .3em; border-radius: 4px; }
pre { background: var(--bg-soft); border: 1px solid var(--line); border-radius: 6px; padding: .7rem .9rem;
      overflow-x: auto; line-height: 1.45; }
table { border-collapse: collapse; margin: .8em 0; font-size: .93rem; display: block; overflow-x: auto; }
th, td { border: 1px solid var(--line); padding: .35rem .6rem; text-align: left; vertical-align: top; }
th { background: var(--bg-soft); font-weight: 600; }
td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
img, svg { max-width: 100%; height: auto; }
.lead { font-size: 1.08rem; color: var(--muted); max-width: 48rem; }
.status { font-size: .8rem; font-weight: 600; padding: .05rem .45rem; border-radius: 1em; white-space: nowrap; }
.status.ok { color: var(--ok); border: 1px solid var(--ok); }
.status.bad { color: var(--bad); border: 1px solid var(--bad); }
.lecture-card { border: 1px solid var(--line); border-radius: 8px; padding: .3rem 1rem .8rem; margin: 1rem 0; }
.lecture-card h3 { margin: .7rem 0 .3rem; }
.lecture-card .meta { color: var(--muted); font-size: .88rem; }
.lecture-card table { margin-bottom: 0; }
.formula { font-family: "STIX Two Math", "Cambria Math", "Latin Modern Math", serif; white-space: nowrap; }
.note { border-left: 4px solid var(--warn); background: #fff8e5; padding: .5rem .8rem; margin: 1rem 0;
        border-radius: 0 6px 6px 0; }
.error-box { border-left: 4px solid var(--bad); background: #ffebe9; padding: .5rem .8rem; margin: 1rem 0;
             border-radius: 0 6px 6px 0; white-space: pre-wrap; font-family: ui-monospace, monospace;
             font-size: .85rem; }
.pager { display: flex; justify-content: space-between; margin: 2rem 0 0; gap: 1rem; }
details summary { cursor: pointer; color: var(--accent); }
/* nbconvert's basic template: cells as a book, without In/Out prompts */
.cell { margin: .6rem 0; }
.prompt { display: none; }
.input_area .highlight, .input_area pre { margin: 0; }
.input_area pre { background: var(--bg-soft); }
.output_wrapper, .output { margin: 0; }
.output_area { margin: .35rem 0 0 .2rem; padding-left: .75rem; border-left: 3px solid var(--line); overflow-x: auto; }
.output_area pre { background: none; border: 0; padding: .15rem 0; margin: 0; }
.output_stderr pre { color: var(--warn); }
.output_error pre { color: var(--bad); }
.output_png img, .output_jpeg img { display: block; margin: .3rem 0; }
.rendered_html table { font-size: .9rem; }
.anchor-link { visibility: hidden; margin-left: .35rem; font-size: .8em; text-decoration: none; }
h1:hover .anchor-link, h2:hover .anchor-link, h3:hover .anchor-link, h4:hover .anchor-link { visibility: visible; }
.ansi-red-fg { color: var(--bad); } .ansi-green-fg { color: var(--ok); } .ansi-yellow-fg { color: var(--warn); }
.ansi-blue-fg { color: #0550ae; } .ansi-cyan-fg { color: #1b7c83; } .ansi-magenta-fg { color: #8250df; }
.ansi-bold { font-weight: 700; }
@media (max-width: 40rem) { header.site nav a { margin-left: 0; margin-right: .8rem; } }
"""


def stylesheet() -> str:
    """style.css: the rules above and Pygments' colours for code (`.highlight`)."""
    return CSS.lstrip() + HtmlFormatter(style="default").get_style_defs(".highlight") + "\n"


def frame(*, title: str, body: str, depth: int, nav: list[tuple[str, str]], here: str, provenance: str,
          mathjax_url: str | None = None) -> str:
    """A whole page. `depth`: folders below the site's root (links are relative, so the site works from disk and
    from any sub-path of a host); `nav`: (label, path from the root); `here`: the path of this page."""
    up = "../" * depth
    here_mark = ' class="here"'
    links = "".join(f'<a href="{up}{escape(path)}"{here_mark if path == here else ""}>{escape(label)}</a>'
                    for label, path in nav)
    math = ""
    if mathjax_url:
        math = f'<script>{MATHJAX_CONFIG}</script>\n<script async src="{escape(mathjax_url)}"></script>\n'
    else:
        body = mathml.typeset(body)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="python -m par site">
<title>{escape(title)} · par</title>
<link rel="stylesheet" href="{up}style.css">
{math}</head>
<body>
<header class="site"><div class="bar"><a class="name" href="{up}index.html">{escape(SITE_NAME)}</a>
<nav>{links}</nav></div></header>
<main>
<div class="provenance">{provenance}</div>
{body}
</main>
<footer class="site">{provenance}</footer>
</body>
</html>
"""
