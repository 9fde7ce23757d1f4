"""Each kind of page of the site, as HTML: the index (syllabus and key numbers), a lecture, an exercise, a doc.

A notebook becomes HTML with nbconvert's `HTMLExporter` (`basic` template: the cells only; figures stay embedded
as data: URIs, so a page is one file). Widgets cannot run on a static page: a progress bar's output is dropped,
any other widget leaves a note saying to open the notebook in JupyterLab. Markdown (docs/*.md) is rendered with
mistune, nbconvert's own renderer; a link to another `.md` of the course becomes a link to its page.
"""
from __future__ import annotations

import copy
import re
from html import escape
from pathlib import Path

from par.site import numbers, theme
from par.site.run import Lecture, BatchRun

WIDGET = "application/vnd.jupyter.widget-view+json"
PROGRESS = re.compile(r"\d+%\|")            # tqdm's text: " 40%|████      | 2/5"
MATH = re.compile(r"\$[^$\s][^$]*\$|\\\(|\\\[|\\begin\{")
WIDGET_NOTE = "(an interactive widget: open this notebook in JupyterLab to use it)"


# --- notebooks ---------------------------------------------------------------------------------------------------

def exporter():
    from nbconvert import HTMLExporter
    return HTMLExporter(template_name="basic")


def static_notebook(nb):
    """A copy of `nb` that a static page can show: figures with their alt text, widget outputs replaced (progress
    bars dropped, other widgets by a note), the widget state removed."""
    import nbformat
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data:
                out = figure_with_alt(out)
            if WIDGET in data:
                if PROGRESS.search(str(data.get("text/plain", ""))):
                    continue
                out = nbformat.v4.new_output("stream", name="stdout", text=WIDGET_NOTE + "\n")
            outputs.append(out)
        if "outputs" in cell:
            cell.outputs = outputs
    return nb


def figure_with_alt(out):
    """A figure's output as an image that carries its alt text: the description the notebook's kernel recorded
    (`par.course.batch.alt_text`: the figure's titles and axis labels), or a plain note where none was."""
    import nbformat
    meta = out.get("metadata", {})
    alt = meta.get("alt") or meta.get("image/png", {}).get("alt") or "A figure (no description was recorded)."
    src = "".join(out["data"]["image/png"].split())
    return nbformat.v4.new_output("display_data", data={"text/html": f'<img src="data:image/png;base64,{src}" '
                                                                     f'alt="{escape(alt)}">'})


def notebook_body(nb, html_exporter) -> str:
    body, _ = html_exporter.from_notebook_node(static_notebook(nb))
    return body


def title_of(nb, default: str) -> str:
    """The notebook's first `# ` heading (the lecture's title), else `default`."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return default


def has_math(text: str) -> bool:
    return bool(MATH.search(text))


# --- markdown ----------------------------------------------------------------------------------------------------

def slug(text: str) -> str:
    return re.sub(r"[^\w]+", "-", re.sub(r"<[^>]+>", "", text).lower()).strip("-") or "section"


def markdown_html(text: str, pages: dict[str, str]) -> str:
    """`text` (GitHub-flavoured markdown) as HTML. `pages`: {the name a link uses (`ta.md`, `../README.md`): the
    site page it becomes}; other relative `.md` links keep their target (the link check reports them)."""
    import mistune

    class Renderer(mistune.HTMLRenderer):
        def link(self, text, url, title=None):
            path, hash_, anchor = url.partition("#")
            if path in pages:
                url = pages[path] + hash_ + anchor
            return super().link(text, url, title)

        def heading(self, text, level, **attrs):
            return f'<h{level} id="{slug(text)}">{text}</h{level}>\n'

    render = mistune.create_markdown(renderer=Renderer(escape=False), plugins=["table", "strikethrough", "url"])
    return render(text)


def markdown_title(text: str, default: str) -> str:
    m = re.search(r"^# (.+)$", text, re.M)
    return m.group(1).strip() if m else default


# --- provenance --------------------------------------------------------------------------------------------------

def _date(value) -> str:
    return str(value).replace("T", " ")[:16] + (" UTC" if str(value).endswith("+00:00") else "") if value else "?"


def provenance_line(run: BatchRun) -> str:
    p = run.provenance
    parts = [f"executed <b>{escape(_date(p.get('date')))}</b>",
             f"on <b>{escape(p.get('machine') or 'a machine the run did not record')}</b>",
             f"backend <b>{escape(str(p.get('backend')))}</b>", f"world size <b>{escape(str(p.get('world_size')))}</b>",
             f"preset <b>{escape(str(p.get('preset')))}</b>", f"<b>{escape(str(p.get('steps')))}</b> steps"]
    if p.get("torch"):
        parts.append(f"torch {escape(p['torch'])}")
    if p.get("commit"):
        parts.append(f"commit {escape(p['commit'])}")
    parts.append(f"run <code>{escape(run.folder.name)}</code>")
    return " · ".join(parts)


def provenance_html(run: BatchRun, others: list[BatchRun]) -> str:
    html = "From the run " + provenance_line(run)
    for other in others:
        html += "<br>Compared with: " + provenance_line(other)
    return html


# --- tables of key numbers ---------------------------------------------------------------------------------------

def _columns(runs: list[BatchRun]) -> str:
    if len(runs) == 1:
        return "<th>this run</th>"
    return "".join(f'<th>run {chr(65 + i)}: {escape(r.label())}</th>' for i, r in enumerate(runs))


def key_numbers_table(stem: str, runs: list[BatchRun]) -> str:
    """The key numbers of the lecture of notebook `stem` (its lecture module's, `numbers.lecture_keys`), one column
    per run, each value beside its verdict where the lecture states a target (in the target column where it says
    more than the formula); '' when no run has any."""
    records = [(r.lecture(stem).records if r.lecture(stem) else {}) for r in runs]
    keys = [k for k in numbers.lecture_keys().get(stem, [])
            if any(numbers.value(rec, k) is not numbers.MISSING for rec in records)]
    if not keys:
        return ""

    def cell(rec, k) -> str:
        verdict = numbers.verdict(k, rec)
        look = "ok" if verdict == numbers.MET else "bad"
        badge = f' <span class="status {look}">{verdict}</span>' if verdict else ""
        return f'<td class="num">{escape(numbers.fmt(numbers.value(rec, k)))}{badge}</td>'
    rows = "".join(
        f'<tr><td>{escape(k.what)}</td><td class="formula">{escape(k.formula)}</td>'
        f'<td class="formula">{escape(k.target.text if k.target and k.target.text != k.formula else "")}</td>'
        + "".join(cell(rec, k) for rec in records) + "</tr>"
        for k in keys)
    return f"<table><thead><tr><th>quantity</th><th>formula / expected</th><th>target</th>{_columns(runs)}</tr>" \
           f"</thead><tbody>{rows}</tbody></table>"


def records_table(stem: str, runs: list[BatchRun]) -> str:
    """Every record of the lecture, one column per run."""
    records = [(r.lecture(stem).records if r.lecture(stem) else {}) for r in runs]
    names = list(dict.fromkeys(name for rec in records for name in rec))
    if not names:
        return "<p>This lecture recorded no numbers in this run.</p>"
    rows = "".join(f"<tr><td><code>{escape(n)}</code></td>"
                   + "".join(f'<td class="num">{escape(numbers.fmt(rec.get(n, numbers.MISSING)))}</td>'
                             for rec in records) + "</tr>" for n in names)
    return f"<table><thead><tr><th>record</th>{_columns(runs)}</tr></thead><tbody>{rows}</tbody></table>"


def status_badge(lecture: Lecture) -> str:
    ok = lecture.status == "ok"
    text = f"ok · {lecture.duration_s:.0f} s" if ok else lecture.status
    return f'<span class="status {"ok" if ok else "bad"}">{escape(text)}</span>'


# --- pages -------------------------------------------------------------------------------------------------------

def lecture_body(lecture: Lecture, title: str, notebook_html: str | None, runs: list[BatchRun],
                 prev: tuple[str, str] | None, next_: tuple[str, str] | None, exercise: str | None) -> str:
    parts = []
    if lecture.status != "ok":
        why = f": {lecture.error}" if lecture.error else ""
        parts.append(f'<div class="error-box">This lecture did not complete in this run ({escape(lecture.status)}'
                     f'{escape(why)}).</div>')
    if notebook_html is None:
        parts.append(f"<h1>{escape(title)}</h1><p>The batch did not execute this notebook, so there is nothing to "
                     f"show; run <code>python -m par batch</code> again where it can run.</p>")
    else:
        parts.append(notebook_html)
    parts.append('<h2 id="key-numbers">Key numbers of this run</h2>')
    parts.append(records_table(lecture.stem, runs))
    if exercise:
        parts.append(f'<p>The exercise of this lecture: <a href="../exercises/{escape(exercise)}.html">'
                     f'{escape(exercise)}</a>.</p>')
    left = f'<a href="{escape(prev[0])}.html">← {escape(prev[1])}</a>' if prev else "<span></span>"
    right = f'<a href="{escape(next_[0])}.html">{escape(next_[1])} →</a>' if next_ else "<span></span>"
    parts.append(f'<div class="pager">{left}{right}</div>')
    return "\n".join(parts)


def exercise_body(name: str, notebook_html: str) -> str:
    stem = Path(name).stem
    return (f'<div class="note">This is the exercise as students get it (the student bundle of '
            f'<code>python -m par exercises release</code>: answers replaced by stubs, hidden checks removed). '
            f'Open <code>exercises/{escape(name)}</code> in JupyterLab, replace each '
            f'<code>raise NotImplementedError("your code here")</code> with your answer, then check it with '
            f'<code>python -m par grade exercises/{escape(name)}</code>.</div>\n{notebook_html}\n'
            f'<p class="pager"><a href="../index.html#exercises">← all exercises</a>'
            f'<span>{escape(stem)}</span></p>')


def index_body(run: BatchRun, runs: list[BatchRun], titles: dict[str, str], exercises: dict[str, str],
               docs: list[tuple[str, str]], missing: list[str]) -> str:
    """The landing page: what the course is, the syllabus with each lecture's key numbers, exercises, docs."""
    lectures = run.lectures
    ok = sum(l.status == "ok" for l in lectures)
    total = sum(l.duration_s for l in lectures)
    parts = ["<h1>Parallel training, run for real</h1>",
             '<p class="lead">How large neural networks are trained on many devices — data parallelism, pipelines, '
             "tensor parallelism, mixed precision, ZeRO, sequence and context parallelism, mixture of experts — "
             "taught by running every technique on several processes. Every figure and number on these pages came "
             "from the code shown beside it, executed by <code>python -m par batch</code> on the machine named "
             "above.</p>",
             f"<p>{ok}/{len(lectures)} lectures executed without error in {total:.0f} s. The code is in the course "
             f"repository: <code>notebooks/</code> (the lectures), <code>exercises/</code>, and <code>par/</code> "
             f"(the package the lectures import).</p>"]
    if missing:
        parts.append(f'<p class="note">This run executed {len(lectures)} of the course\'s lectures; not in it: '
                     f'{escape(", ".join(missing))}.</p>')
    parts.append('<h2 id="syllabus">Syllabus</h2>')
    if len(runs) > 1:
        parts.append("<p>Key numbers of " + " and ".join(
            f"run {chr(65 + i)} ({escape(r.label())}, <code>{escape(r.folder.name)}</code>)" for i, r in
            enumerate(runs)) + ", side by side.</p>")
    for lecture in lectures:
        exercise = exercises.get(lecture.exercise_number)
        meta = [status_badge(lecture)]
        if lecture.error:
            meta.append(f"<span>{escape(lecture.error[:160])}</span>")
        if exercise:
            meta.append(f'exercise: <a href="exercises/{escape(exercise)}.html">{escape(exercise)}</a>')
        table = key_numbers_table(lecture.stem, runs)
        parts.append(f'<section class="lecture-card" id="lecture-{escape(lecture.stem)}">'
                     f'<h3><a href="lectures/{escape(lecture.stem)}.html">{escape(titles[lecture.stem])}</a></h3>'
                     f'<div class="meta">{" · ".join(meta)}</div>{table}</section>')
    parts.append('<h2 id="exercises">Exercises</h2>')
    parts.append("<p>Each lecture has a graded exercise (a lecture NNb, the second part of lecture NN, shares NN's), "
                 "shown here as students get it (no solutions, no hidden "
                 "checks). Open it in JupyterLab, write the answers, then <code>python -m par grade "
                 "exercises/NN_topic.ipynb</code>.</p>")
    parts.append("<ul>" + "".join(f'<li><a href="exercises/{escape(stem)}.html">{escape(stem)}</a></li>'
                                  for stem in exercises.values()) + "</ul>")
    if docs:
        parts.append('<h2 id="teaching">Teaching and running the course</h2><ul>'
                     + "".join(f'<li><a href="{escape(path)}">{escape(label)}</a></li>' for label, path in docs)
                     + "</ul>")
    parts.append('<h2 id="build">This site</h2><p>Built by <code>python -m par site</code> from the batch folder '
                 f'<code>{escape(run.folder.name)}</code> (its <code>summary.json</code> and executed notebooks); '
                 'copy the folder to any static host to publish it.</p>')
    return "\n".join(parts)


def page(*, title: str, body: str, depth: int, nav, here: str, provenance: str, mathjax_url: str | None) -> str:
    return theme.frame(title=title, body=body, depth=depth, nav=nav, here=here, provenance=provenance,
                       mathjax_url=mathjax_url if mathjax_url and has_math(body) else None)
