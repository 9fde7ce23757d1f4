"""The lecture pages as a lecturer reads them aloud and a student reads them on the website.

- every lecture notebook has at most 2,400 words of markdown;
- no lecture speaks of the course's own making: its tests, its issues, its CI (a short list of phrases, in the
  markdown and in the strings its code prints);
- the site built from every lecture notebook (with the exercises and docs/) shows every formula typeset (no `$…$`
  left in the text a reader sees, no formula the converter could not read; docs/*.md write theirs in plain text,
  since their markdown renderer has no math) and fetches nothing from the network (no script, stylesheet, image,
  frame or font from an http(s) address).

Each test reports every offending notebook or page in one message. Static: the notebooks are read, not executed;
the site is built from them as they are in the repository, with the formula every `show(..., formula=...)` cell
prints put in as its output.
"""
from __future__ import annotations

import ast
import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from par.site import build, mathml, numbers

ROOT = Path(__file__).resolve().parents[1]
LECTURES = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
MAX_WORDS = 2400
WORD = re.compile(r"\S+")

# Sentences about how the course itself is built and checked, which a lecture should state in its own terms.
PROCESS = {
    "the tests": re.compile(r"\bthe tests\b", re.I),
    "test suite": re.compile(r"\btest suite\b", re.I),
    "a test file": re.compile(r"\btests/\S*|\btest_\w+\.py\b"),
    "pytest": re.compile(r"\bpytest\b", re.I),
    "the issue": re.compile(r"\bthe issue\b", re.I),
    "CI": re.compile(r"\bCI\b"),
}


def markdown_words(path: Path) -> int:
    cells = json.loads(path.read_text())["cells"]
    return sum(len(WORD.findall("".join(c["source"]))) for c in cells if c["cell_type"] == "markdown")


def code_strings(source: str) -> list[str]:
    """The string literals of a code cell (f-strings' literal parts included): what its output can say."""
    lines = [l for l in source.splitlines() if not l.lstrip().startswith(("%", "!"))]
    tree = ast.parse("\n".join(lines))
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def process_phrases(path: Path) -> list[str]:
    """'[cell index] phrase: …context…' for every phrase of PROCESS in the notebook's markdown and code strings."""
    found = []
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        texts = [source] if cell["cell_type"] == "markdown" else code_strings(source) if cell["cell_type"] == "code" \
            else []
        for text in texts:
            for name, pattern in PROCESS.items():
                for m in pattern.finditer(text):
                    context = " ".join(text[max(0, m.start() - 50):m.end() + 30].split())
                    found.append(f"[{i}] {name!r}: …{context}…")
    return found


def test_every_lecture_has_at_most_2400_words_of_markdown():
    over = {p.stem: markdown_words(p) for p in LECTURES if markdown_words(p) > MAX_WORDS}
    if over:
        pytest.fail(f"lectures over {MAX_WORDS} words of markdown (cut, or move appendix material to "
                    f"docs/instructor.md): " + ", ".join(f"{stem} {n}" for stem, n in over.items()), pytrace=False)


def test_no_lecture_speaks_of_the_courses_own_making():
    found = {p.stem: process_phrases(p) for p in LECTURES}
    found = {stem: hits for stem, hits in found.items() if hits}
    if found:
        pytest.fail("lectures that speak of how the course is built or checked (say what is true in the lecture's "
                    "own terms):\n" + "\n".join(f"{stem} {hit}" for stem, hits in found.items() for hit in hits),
                    pytrace=False)


def test_the_phrase_check_finds_process_talk_and_leaves_course_content_alone(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("The largest gap is what the tests hold every run to (`tests/test_tp.py`)."),
        nbformat.v4.new_code_cell('say(f"{x:.2f}: within the issue\'s target")\n# the tests: a comment, not output'),
        nbformat.v4.new_markdown_cell("A test of the formula: the checks compare the latest tests of a batch. "
                                      "Attest to the CIFAR issues.")])
    path = tmp_path / "99_example.ipynb"
    nbformat.write(nb, path)
    hits = process_phrases(path)
    assert [h.split(":")[0] for h in hits] == ["[0] 'the tests'", "[0] 'a test file'", "[1] 'the issue'"], hits


# --- the site ----------------------------------------------------------------------------------------------------

def with_formula_outputs(nb):
    """`nb` with each `show(..., formula=r"...")` cell's output as the notebook shows it: the formula as display
    math (par.course.show's markdown)."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        formulas = [kw.value.value for s in [cell.source] for n in ast.walk(ast.parse(
            "\n".join(l for l in s.splitlines() if not l.lstrip().startswith(("%", "!")))))
            if isinstance(n, ast.Call) for kw in n.keywords
            if kw.arg == "formula" and isinstance(kw.value, ast.Constant)]
        cell.outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": f"$${f}$$",
                                                                      "text/plain": f}) for f in formulas]
    return nb


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site of a run holding every lecture notebook of the repository, the course's exercises and docs/, and a
    value for every key number (so the syllabus shows every formula column)."""
    run = tmp_path_factory.mktemp("runs") / "20260101-120000"
    run.mkdir()
    keys = numbers.lecture_keys()
    rows = []
    for path in LECTURES:
        nbformat.write(with_formula_outputs(nbformat.read(path, as_version=4)), run / path.name)
        records: dict = {}
        for key in keys.get(path.stem, []):
            if key.part is None:
                records[key.record] = 0.5
            else:
                records.setdefault(key.record, {})[key.part] = 0.5
        rows.append({"notebook": path.name, "status": "ok", "error": None, "duration_s": 1.0, "records": records})
    provenance = {"date": "2026-01-01T12:00:00+00:00", "machine": "Linux x86_64, 2 CPUs (test)", "backend": "gloo",
                  "world_size": 2, "preset": "tiny", "steps": 20}
    (run / "summary.json").write_text(json.dumps({"folder": str(run), "parameters": {}, "provenance": provenance,
                                                  "notebooks": rows, "failed": 0, "duration_s": 14.0}))
    exercises = {p.name: p.read_text() for p in sorted((ROOT / "exercises").glob("*.ipynb"))}
    out = run.parent / "site"
    build.build(run, out=out, mathjax_url=None, exercises=exercises, references=[])
    return out


# TeX the renderer's own pattern might miss: a command (`\frac`), or `$…$` around TeX's ^ _ { } (prices stay prose)
TEX = re.compile(r"\\[A-Za-z]+|\$[^$]*[\\^_{}][^$]*\$")


def visible_text(page: str) -> str:
    """What a reader reads as prose: the page without its code, typeset formulas and tags, entities decoded."""
    prose = re.sub(r"<(pre|code|math|script|style)\b[^>]*>.*?</\1>", "\n", page, flags=re.S | re.I)
    return html.unescape(re.sub(r"<[^>]+>", "\n", prose))


class Fetches(HTMLParser):
    """Every address a browser would fetch by itself while showing the page (not the links a reader may follow)."""
    FETCHED = {"script": ("src",), "link": ("href",), "img": ("src", "srcset"), "iframe": ("src",),
               "source": ("src", "srcset"), "video": ("src", "poster"), "audio": ("src",), "embed": ("src",),
               "object": ("data",), "track": ("src",), "input": ("src",)}

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.styles: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for name in self.FETCHED.get(tag, ()):
            if a.get(name):
                self.urls += [part.split()[0] for part in a[name].split(",") if part.split()]
        if a.get("style"):
            self.styles.append(a["style"])
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False if tag == "style" else self._in_style

    def handle_data(self, data):
        if self._in_style:
            self.styles.append(data)


REMOTE = re.compile(r"^\s*(https?:|wss?:|//)", re.I)
CSS_URL = re.compile(r"url\(\s*['\"]?([^'\")]+)|@import\s+['\"]([^'\"]+)", re.I)


def remote_fetches(page: str) -> list[str]:
    parser = Fetches()
    parser.feed(page)
    css = [u for s in parser.styles for m in CSS_URL.finditer(s) for u in m.groups() if u]
    return [u for u in parser.urls + css if REMOTE.match(u)]


def test_every_formula_of_every_lecture_is_typeset_on_the_site(site):
    problems = []
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        where = str(page.relative_to(site))
        prose = visible_text(text)
        problems += [f"{where}: raw TeX {tex!r}" for tex in mathml.raw_tex_left(prose)]
        problems += [f"{where}: raw TeX …{' '.join(prose[max(0, m.start() - 40):m.end() + 20].split())}…"
                     for m in TEX.finditer(prose)]
        problems += [f"{where}: TeX the converter could not read: {html.unescape(t)!r}"
                     for t in re.findall(r'<code class="tex">(.*?)</code>', text, re.S)]
    assert {f"lectures/{p.stem}.html" for p in LECTURES} <= {str(p.relative_to(site)) for p in site.rglob("*.html")}
    if problems:
        pytest.fail("formulas a reader would see as TeX:\n" + "\n".join(problems), pytrace=False)
    assert "<math" in (site / "lectures" / "05_mixed_precision.html").read_text()
    # docs/*.md are rendered by mistune, which has no math: its backslash escapes would eat TeX's `\,` unseen
    tex_in_docs = {p.name: mathml.raw_tex_left(p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))}
    assert {name: tex for name, tex in tex_in_docs.items() if tex} == {}, "write the docs' formulas in plain text"


def test_no_page_of_the_site_fetches_from_the_network(site):
    fetched = {str(p.relative_to(site)): remote_fetches(p.read_text(encoding="utf-8"))
               for p in sorted(site.rglob("*.html"))}
    fetched["style.css"] = [u for m in CSS_URL.finditer((site / "style.css").read_text()) for u in m.groups()
                            if u and REMOTE.match(u)]
    assert {page: urls for page, urls in fetched.items() if urls} == {}
    assert remote_fetches('<script src="https://cdn.example/mathjax.js"></script><link rel="stylesheet" '
                          'href="//fonts.example/a.css"><a href="https://example.org">a link</a>'
                          '<div style="background: url(https://x.example/i.png)"></div>') == \
        ["https://cdn.example/mathjax.js", "//fonts.example/a.css", "https://x.example/i.png"]
