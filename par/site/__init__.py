"""The executed course as a static website: `python -m par site [RUN_DIR] [--out DIR] [--compare RUN_A RUN_B]`.

A batch (`python -m par batch`) leaves executed notebooks and `summary.json` in `runs/<time>/`; this package
turns that folder into plain HTML files one can open from disk or copy to any static host (GitHub Pages, a
university web folder, `python -m http.server`):

    index.html                  the syllabus: every lecture, its status, and its key numbers beside their formulas
    lectures/NN_topic.html      one page per lecture: text, code, outputs, figures (images embedded)
    exercises/NN_topic.html     the exercises as students get them (the student bundle: no solutions, no hidden checks)
    docs/NAME.html              the instructor, TA and cluster pages (docs/*.md)
    style.css, par-site.json    the look; what was built from which run

Every page says where its numbers came from (date, machine, backend, world size, preset: the run's
`provenance`). With `--compare RUN_A RUN_B` the key numbers of both runs stand in two columns (a CPU run beside
a GPU run).

The tool: nbconvert's `HTMLExporter` (its `basic` template: the cells as HTML, nothing else) with a small index,
page frame and style of our own, and `mistune` (nbconvert's own markdown renderer) for docs/*.md. Both are
already installed with Jupyter, so the build needs no new dependency, no Node, and nothing from the network,
and it takes seconds: a notebook is one exporter call (formulas need `latex2mathml`, a small pure-Python package). Jupyter Book or Sphinx with MyST-NB would give a search
box and cross-references, but they are not in the course's environment, pull in a large toolchain, and would
re-implement what the index here does in a dozen lines. Formulas in the notebooks' text become MathML when the
site is built (`mathml`), which browsers draw without a script or the network: a site read offline, or on a closed
network, shows every formula (`--mathjax URL` typesets them in the reader's browser with a MathJax of your own
instead).

One idea per file: `mathml` (formulas typeset at build time), `run` (reading a batch's folder), `numbers` (the key numbers each lecture shows, beside
their formulas), `exercises` (the student versions, from the release bundle), `pages` (a notebook or a markdown
file as a page), `theme` (the frame and style of every page), `build` (the command: check, write, time).
"""
