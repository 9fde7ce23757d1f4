"""`python -m par site`: the executed course as a website, checked as a reader meets it.

The site is built from a small executed run made here (no kernel: three lectures written with nbformat as the
batch leaves them: an ok one with a figure, a formula, a progress bar and records; a failed one with its
traceback; one the batch did not run) and the course's real exercises and docs/.

Fast tier: the pages exist and link each other, the syllabus lists every lecture with its key numbers, every
page says where its numbers came from, two runs side by side, no solution or hidden check reaches the site, and
bad input is refused in one line. Full suite: every page opened in headless Chromium (tests/chromium.py): no
console error, every image decoded with a nonzero size, every internal link resolves, the syllabus lists every
lecture.
"""
from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest
from chromium import launched, needs_chromium
from tiers import slow

from par.course.authoring import markers
from par.site import build, mathml, numbers, theme

ROOT = Path(__file__).resolve().parents[1]
LECTURES = ["03_pipelines", "08_sequence_context_parallel", "09_mixture_of_experts"]
# for the builds that test something else than the exercises (the real release takes seconds)
EXERCISES = {"03_pipelines.ipynb": nbformat.writes(nbformat.v4.new_notebook(cells=[
    nbformat.v4.new_markdown_cell("# Exercise 03")]))}


def png(width: int = 320, height: int = 200) -> str:
    """A real figure, as a notebook keeps it (base64 PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(width / 100, height / 100), dpi=100)
    ax.plot([1, 2, 4, 8], [0.75, 0.6, 0.43, 0.27], marker="o", label="measured")
    ax.set_xlabel("micro-batches m")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def record(name, value) -> dict:
    return nbformat.v4.new_output("display_data", data={"application/vnd.par.record+json": {name: value},
                                                          "text/plain": f"{name} = {value}"})


def executed_run(folder: Path, stamp: str = "20260101-120000", backend: str = "gloo", world_size: int = 2,
                 bubble: float = 0.2) -> Path:
    """A batch's folder as `python -m par batch` leaves it, for three lectures (see the module docstring)."""
    run = folder / stamp
    run.mkdir(parents=True)
    ok = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 03 · Model parallelism and pipelines\n\nThe bubble is "
                                      "$\\frac{p-1}{m+p-1}$ of the step.\n\n## 1. A schedule"),
        nbformat.v4.new_code_cell("world_size = 2", execution_count=1),
        nbformat.v4.new_code_cell("from tqdm.auto import tqdm\nfor m in tqdm([1, 2, 4, 8]): pass\nplot()",
                                  execution_count=2, outputs=[
            nbformat.v4.new_output("display_data", data={
                "application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2,
                                                             "version_minor": 0},
                "text/plain": "  0%|          | 0/4 [00:00<?, ?it/s]"}),
            nbformat.v4.new_output("stream", name="stderr", text="a warning\n"),
            nbformat.v4.new_output("display_data", data={
                "application/vnd.jupyter.widget-view+json": {"model_id": "def", "version_major": 2,
                                                             "version_minor": 0},
                "text/plain": "interactive(children=(Dropdown(value='bf16'),))"}),
            nbformat.v4.new_output("display_data", data={"image/png": png(), "text/plain": "<Figure>"}),
            record("bubble_measured_vs_m", {"1f1b": {"1": 0.5, "4": bubble}}),
            record("bubble_formula_vs_m", {"1f1b": {"1": 0.5, "4": 0.2}}),
            record("pipeline_max_grad_diff_vs_single", 1.2e-7)])])
    ok.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nbformat.write(ok, run / "03_pipelines.ipynb")
    failed = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 08 — Sequence and context parallelism"),
        nbformat.v4.new_code_cell("1 / 0", execution_count=1, outputs=[nbformat.v4.new_output(
            "error", ename="ZeroDivisionError", evalue="division by zero",
            traceback=["\x1b[0;31mZeroDivisionError\x1b[0m: division by zero"])])])
    nbformat.write(failed, run / "08_sequence_context_parallel.ipynb")
    rows = [{"notebook": "03_pipelines.ipynb", "status": "ok", "error": None, "duration_s": 12.5,
             "records": {"bubble_measured_vs_m": {"1f1b": {"1": 0.5, "4": bubble}},
                         "bubble_formula_vs_m": {"1f1b": {"1": 0.5, "4": 0.2}},
                         "pipeline_max_grad_diff_vs_single": 1.2e-7}},
            {"notebook": "08_sequence_context_parallel.ipynb", "status": "FAILED",
             "error": "ZeroDivisionError: division by zero", "duration_s": 3.0, "records": {}},
            {"notebook": "09_mixture_of_experts.ipynb", "status": "not run", "error": "needs 3 GPUs, this server has 2",
             "duration_s": 0.0, "records": {}, "output": None}]
    parameters = {"world_size": world_size, "backend": "auto", "preset": "tiny", "steps": 20}
    provenance = {"date": "2026-01-01T12:00:00+00:00", "machine": f"Linux x86_64, 2 CPUs (test), {backend}",
                  "backend": backend, "world_size": world_size, "preset": "tiny", "steps": 20, "torch": "2.13.0",
                  "commit": "abc1234"}
    (run / "summary.json").write_text(json.dumps({"folder": str(run), "parameters": parameters,
                                                  "provenance": provenance, "notebooks": rows, "failed": 2,
                                                  "duration_s": 15.5, "records": {}}))
    return run


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site of a small run, built once by `python -m par site --out public` in the folder that holds runs/
    (the command's entry point, in this process: a real `python -m par` is run by the refusals' test)."""
    from par.__main__ import main
    course = tmp_path_factory.mktemp("course")
    executed_run(course / "runs")
    here = os.getcwd()
    os.chdir(course)
    try:
        assert main(["site", "--out", "public"]) == 0
    finally:
        os.chdir(here)
    return course / "public"


def pages_of(site: Path) -> list[Path]:
    return sorted(site.rglob("*.html"))


class Links(HTMLParser):
    """Every href/src of a page, and every id it defines."""

    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        for key in ("href", "src"):
            if a.get(key):
                self.links.append(a[key])


def parsed(page: Path) -> Links:
    p = Links()
    p.feed(page.read_text(encoding="utf-8"))
    return p


def text_of(page: Path) -> str:
    """What a reader sees: the page without tags, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


def broken_links(site: Path) -> list[str]:
    """Internal links whose file (or #fragment in it) does not exist."""
    broken = []
    for page in pages_of(site):
        for link in parsed(page).links:
            url = urlsplit(link)
            if url.scheme or link.startswith("//"):
                continue          # data: images, the MathJax CDN
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            if not target.is_file() or site.resolve() not in target.parents:
                broken.append(f"{page.relative_to(site)}: {link}")
            elif url.fragment and target.suffix == ".html" and \
                    not {url.fragment, unquote(url.fragment)} & parsed(target).ids:      # ids may be %-encoded
                broken.append(f"{page.relative_to(site)}: {link} (no such anchor)")
    return broken


# --- fast tier --------------------------------------------------------------------------------------------------

def test_the_site_has_the_syllabus_every_lecture_exercise_and_doc(site):
    info = json.loads((site / build.MARKER).read_text())
    assert sorted(info["pages"]) == sorted(str(p.relative_to(site)) for p in pages_of(site))
    assert {f"lectures/{s}.html" for s in LECTURES} <= set(info["pages"])
    exercises = sorted(p.stem for p in (ROOT / "exercises").glob("*.ipynb"))
    assert sorted(p.stem for p in (site / "exercises").glob("*.html")) == exercises
    docs = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    assert {"instructor", "ta", "cluster"} <= set(docs)
    assert sorted(p.stem for p in (site / "docs").glob("*.html")) == docs
    index = parsed(site / "index.html").links
    for stem in LECTURES:
        assert f"lectures/{stem}.html" in index, f"the syllabus does not link {stem}"
    for stem in exercises:
        assert f"exercises/{stem}.html" in index
    for stem in docs:
        assert f"docs/{stem}.html" in index
    assert broken_links(site) == []


def test_lecture_pages_show_text_code_outputs_figures_and_status(site):
    page = (site / "lectures" / "03_pipelines.html").read_text()
    assert "03 · Model parallelism and pipelines" in page and "world_size" in page
    assert re.search(r'<img [^>]*src="data:image/png;base64,', page)
    assert "a warning" in page and "0/4" not in page and "widget-state" not in page   # no dead progress bar
    assert "interactive widget: open this notebook in JupyterLab" in page and "Dropdown" not in page
    assert "<math " in page and "mathjax" not in page.lower()           # its formulas, as MathML, no script
    assert mathml.raw_tex_left(text_of(site / "lectures" / "03_pipelines.html")) == []
    assert "Key numbers of this run" in page and "bubble_measured_vs_m" in page
    failed = text_of(site / "lectures" / "08_sequence_context_parallel.html")
    assert "did not complete" in failed and "ZeroDivisionError" in failed
    not_run = text_of(site / "lectures" / "09_mixture_of_experts.html")
    assert "not run" in not_run and "needs 3 GPUs" in not_run
    assert "<script" not in (site / "docs" / "ta.html").read_text()


def test_the_index_shows_key_numbers_beside_their_formulas_and_targets(site):
    text = text_of(site / "index.html")
    for key in numbers.lecture_keys()["03_pipelines"]:
        if (key.record, key.part) in (("bubble_measured_vs_m", "1f1b"), ("pipeline_max_grad_diff_vs_single", None)):
            assert key.what in text and key.formula in text
    assert "1: 0.5, 4: 0.2" in text and "1.2e-07 met" in text and "≤ 1e-5" in text   # 1.2e-7 meets "≤ 1e-5"
    assert "torch pipelining" not in text             # a record the run lacks is left out, not shown empty


def test_a_target_is_data_the_site_evaluates_to_a_verdict():
    key = numbers.Key("bubble gap", "≤ 0.05", "gap", target=numbers.at_most(0.05))
    assert numbers.verdict(key, {"gap": 0.03}) == numbers.MET and numbers.verdict(key, {"gap": 0.06}) == numbers.MISSED
    assert numbers.verdict(key, {}) == "" and numbers.verdict(key, {"gap": "n/a"}) == ""
    per_m = numbers.Key("ratio", "→ 1", "r", "zb", target=numbers.near(1.0, 0.05))
    assert numbers.verdict(per_m, {"r": {"zb": {"4": 0.97, "8": 1.02}}}) == numbers.MET
    assert numbers.verdict(per_m, {"r": {"zb": {"4": 0.97, "8": 1.2}}}) == numbers.MISSED   # every number must hold
    assert numbers.verdict(numbers.Key("equal", "", "e", target=numbers.equal(True)), {"e": False}) == numbers.MISSED
    assert numbers.verdict(numbers.Key("no target", "", "x"), {"x": 1.0}) == ""
    assert numbers.Key.from_dict(json.loads(json.dumps(key.to_dict()))) == key     # what the command hands the site


def test_key_numbers_are_records_of_their_own_lecture():
    """Every lecture has its key numbers (its lecture module's, read through `python -m par.course.lectures`), and each
    is a record its own notebook makes (a section moved to another lecture takes its key numbers with it); a lecture NNb shows the
    exercise of NN."""
    from par.site.run import Lecture
    lectures = [Lecture(p.stem, "ok", None, 0.0, {}, None) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    keys = numbers.lecture_keys()
    assert sorted(keys) == sorted(l.stem for l in lectures)
    for lecture in lectures:
        cells = json.loads((ROOT / "notebooks" / f"{lecture.stem}.ipynb").read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for key in keys[lecture.stem]:
            checked = re.search(rf'check\([^,()]+,\s*"{re.escape(key.record)}"', code)   # claims.check records it
            assert f'record("{key.record}"' in code or checked, f"{lecture.stem} does not record {key.record!r}"
        assert list((ROOT / "exercises").glob(f"{lecture.exercise_number}_*.ipynb")), lecture.stem
    assert Lecture("07b_at_scale", "ok", None, 0.0, {}, None).exercise_number == "07"


def test_every_page_says_where_its_numbers_came_from(site):
    for page in pages_of(site):
        text = text_of(page)
        for fact in ("2026-01-01 12:00", "Linux x86_64, 2 CPUs (test)", "backend gloo", "world size 2",
                     "preset tiny", "20260101-120000"):
            assert fact in text, f"{page.relative_to(site)} lacks {fact!r}"


def test_no_solution_or_hidden_check_reaches_the_site(site):
    """Every line of every solution region and hidden check (longer than a stub) is absent from every page."""
    secret = set()
    for solution in sorted((ROOT / "solutions").glob("*.ipynb")):
        exercise = (ROOT / "exercises" / solution.name).read_text()
        for cell in nbformat.read(solution, as_version=4).cells:
            for begin, end in ((markers.BEGIN, markers.END), (markers.HIDDEN_BEGIN, markers.HIDDEN_END)):
                for region in re.findall(re.escape(begin) + r"(.*?)" + re.escape(end), cell.source, re.S):
                    secret |= {line.strip() for line in region.splitlines()
                               if len(line.strip()) >= 16 and json.dumps(line.strip())[1:-1] not in exercise}
    assert len(secret) > 50, "the solutions' answers were not found: the check would prove nothing"
    texts = {page.relative_to(site): text_of(page) for page in pages_of(site)}
    for page, text in texts.items():
        assert not [m for m in markers.LEAKING if m in text], page
        leaked = sorted(line for line in secret if line in text)
        assert leaked == [], f"{page} shows answers or hidden checks: {leaked[:3]}"
    assert markers.STUB in texts[Path("exercises/00_ring_chunks.html")]


def test_two_runs_side_by_side(tmp_path):
    cpu = executed_run(tmp_path / "runs", "20260101-120000", "gloo", 2, bubble=0.2)
    gpu = executed_run(tmp_path / "runs", "20260102-120000", "nccl", 8, bubble=0.21)
    info = build.build(compare=(cpu, gpu), out=tmp_path / "site", mathjax_url=None, exercises=EXERCISES)
    assert info["compare"] == [str(cpu), str(gpu)] and info["run"] == str(cpu)
    index = text_of(tmp_path / "site" / "index.html")
    assert "run A: gloo × 2, tiny, 20 steps" in index and "run B: nccl × 8, tiny, 20 steps" in index
    assert "1: 0.5, 4: 0.2" in index and "1: 0.5, 4: 0.21" in index
    assert "Compared with" in text_of(tmp_path / "site" / "lectures" / "03_pipelines.html")
    assert "mathjax" not in (tmp_path / "site" / "lectures" / "03_pipelines.html").read_text().lower()


def test_a_reference_run_in_the_repository_is_shown_beside_the_run_by_default(tmp_path):
    course = tmp_path / "course"
    gpu = executed_run(course / "docs" / "reference-runs" / "h200" / "batch", "20261127-090000", "nccl", 1,
                       bubble=0.19)
    cpu = executed_run(tmp_path / "runs", "20261127-100000", "gloo", 2, bubble=0.2)
    info = build.build(cpu, out=tmp_path / "site", mathjax_url=None, exercises=EXERCISES, root=course)
    assert info["compare"] == [str(cpu), str(gpu)]
    index = text_of(tmp_path / "site" / "index.html")
    assert "run A: gloo × 2, tiny, 20 steps" in index and "run B: reference, nccl × 1, tiny, 20 steps" in index
    assert "1: 0.5, 4: 0.2" in index and "1: 0.5, 4: 0.19" in index
    lecture = text_of(tmp_path / "site" / "lectures" / "03_pipelines.html")
    assert "Compared with" in lecture and "20261127-090000" in lecture
    alone = build.build(cpu, out=tmp_path / "alone", mathjax_url=None, exercises=EXERCISES, root=course,
                        references=[])
    assert alone["compare"] == [] and "reference" not in text_of(tmp_path / "alone" / "index.html")


def test_a_broken_reference_run_is_refused_in_one_line(tmp_path):
    course = tmp_path / "course"
    broken = course / "docs" / "reference-runs" / "h100"
    broken.mkdir(parents=True)
    (broken / "summary.json").write_text('{"notebooks": [')
    cpu = executed_run(tmp_path / "runs")
    with pytest.raises(build.SiteError, match="h100/summary.json is not a batch summary"):
        build.build(cpu, out=tmp_path / "site", mathjax_url=None, exercises=EXERCISES, root=course)
    assert not (tmp_path / "site").exists()


def test_a_rebuild_replaces_an_earlier_site_and_the_default_is_the_latest_run(tmp_path):
    executed_run(tmp_path / "runs", "20260101-120000")
    newer = executed_run(tmp_path / "runs", "20260102-120000")
    first = build.build(runs_root=tmp_path / "runs", mathjax_url=None, exercises=EXERCISES)
    assert first["out"] == str(newer / "site")
    (newer / "site" / "stale.html").write_text("old")
    build.build(newer, mathjax_url=None, exercises=EXERCISES)
    assert not (newer / "site" / "stale.html").exists() and (newer / "site" / "index.html").is_file()


def test_bad_input_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """Each refusal: exit 2, one line `error: ...` naming the fix, no traceback, nothing written or deleted.
    The first goes through a real `python -m par`, the others through the same entry point in this process."""
    done = subprocess.run([sys.executable, "-m", "par", "site"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (2, "", "error: no executed run under runs/: run "
                                                                  "`python -m par batch` first (or name a run folder: "
                                                                  "python -m par site RUN_DIR)\n")
    from par.__main__ import main
    monkeypatch.chdir(tmp_path)

    def refused(*args: str) -> str:
        assert main(["site", *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        return err

    (tmp_path / "runs").mkdir()
    assert "no executed run under runs/" in refused()
    assert "no run folder nowhere" in refused("nowhere")
    assert "has no summary.json" in refused("runs")
    run = executed_run(tmp_path / "runs")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    assert "holds files of something else" in refused(str(run), "--out", "taken")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert "would replace the run" in refused(str(run), "--out", str(run))
    (tmp_path / "file").write_text("x")
    assert "is a file" in refused(str(run), "--out", "file")
    assert "cannot" in refused(str(run), "--out", "/proc/par-site")
    assert "--compare" in refused("--compare", str(run))
    (run / "summary.json").write_text("{not json")
    assert "is not a batch summary" in refused(str(run))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "runs", "taken"]


# --- full suite: in a browser -----------------------------------------------------------------------------------

def browser_problems(browser, site: Path) -> tuple[list[str], dict]:
    """Open every page of `site` from disk: (the problems a reader would meet: console errors, uncaught exceptions,
    images not decoded or of no size, links to missing files, any request to the network (a site is read offline:
    the network is blocked and each request counted), formulas left as raw TeX; {page: what it shows}: the
    syllabus' lecture links of the index, the number of images and of typeset formulas of each page)."""
    problems, seen = [], {}
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    requested: list[str] = []
    context.route(re.compile(r"^(https?|wss?)://"), lambda route: (requested.append(route.request.url), route.abort()))
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    try:
        for path in pages_of(site):
            errors.clear()
            page.goto(path.as_uri(), wait_until="load")
            images = page.evaluate("""() => [...document.images].map(i => ({src: i.src.slice(0, 60),
                                        ok: i.complete && i.naturalWidth > 0 && i.naturalHeight > 0}))""")
            links = page.evaluate("""() => [...document.querySelectorAll('a[href]')].map(a => a.href)
                                        .filter(h => h.startsWith('file:'))""")
            missing = [h for h in links if not Path(unquote(urlsplit(h).path)).is_file()]
            where = str(path.relative_to(site))
            problems += [f"{where}: {e}" for e in errors]
            problems += [f"{where}: image not decoded: {i['src']}" for i in images if not i["ok"]]
            problems += [f"{where}: link to a missing file: {h}" for h in missing]
            problems += [f"{where}: network request: {url}" for url in requested]
            requested.clear()
            raw = mathml.raw_tex_left(page.evaluate("""() => { const out = [];           // the text a reader reads
                const w = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
                for (let n = w.nextNode(); n; n = w.nextNode())
                    if (!n.parentElement.closest('pre, code, script, style, math')) out.push(n.textContent);
                return out.join('\\n'); }"""))
            problems += [f"{where}: raw TeX: {tex}" for tex in raw[:3]]
            seen[where] = {"images": len(images), "formulas": page.evaluate("() => document.querySelectorAll('math').length"),
                           "syllabus": page.evaluate(
                "() => [...document.querySelectorAll('.lecture-card h3 a')].map(a => a.getAttribute('href'))")}
    finally:
        context.close()
    return problems, seen


@slow
@needs_chromium
def test_every_page_renders_in_chromium(site):
    """Each page opened from disk: no console error or uncaught exception, every image decoded with a size,
    every internal link's file present, no request to the network (it is blocked), no formula left as raw TeX, and
    the syllabus lists every lecture."""
    with launched() as browser:
        problems, seen = browser_problems(browser, site)
        broken = site.parent / "broken"                  # the check itself: it sees a broken page
        shutil.copytree(site, broken)
        index = broken / "index.html"
        index.write_text(index.read_text().replace("</main>", '<img src="missing.png"><a href="nowhere.html">x</a>'
                                                              '<script>console.error("boom")</script>'
                                                              '<img src="https://example.org/x.png"><p>$x^2$</p></main>'))
        found, _ = browser_problems(browser, broken)
    assert problems == []
    assert seen["index.html"]["syllabus"] == [f"lectures/{s}.html" for s in LECTURES]
    assert seen["lectures/03_pipelines.html"]["images"] == 1
    assert seen["lectures/03_pipelines.html"]["formulas"] > 0
    assert len(seen) == len(pages_of(site))
    kinds = {p.split(": ", 1)[1].split(":")[0] for p in found}
    assert {"console error", "image not decoded", "link to a missing file", "network request", "raw TeX"} <= kinds, \
        found
    assert any(p.endswith("console error: boom") for p in found) and all(p.startswith("index.html: ") for p in found)


def test_formulas_become_mathml_and_code_and_prices_stay_as_written():
    page = ('<p>The bubble is $(p-1)/(m+p-1)$; it costs $5 or $6.</p><pre>$ python -m par</pre>'
            '<p>$$\\frac{a}{b} &lt; 1$$</p><code>$x$</code><p>$\\unknowncommand{$</p><img alt="$x$">')
    out = mathml.typeset(page)
    assert out.count('display="inline"') == 1 and out.count('display="block"') == 1
    assert "costs $5 or $6." in out and "<pre>$ python -m par</pre>" in out and "<code>$x$</code>" in out
    assert 'alt="$x$"' in out and "<mo>&#x0003C;</mo>" in out             # an entity in TeX is read as its character
    assert '<code class="tex">\\unknowncommand{</code>' in out               # unreadable TeX stays visible
    prose = re.sub(r"<(pre|code)>.*?</\1>", "\n", out)                   # what a reader reads as text
    assert mathml.raw_tex_left(html.unescape(re.sub(r"<[^>]+>", "\n", prose))) == []
    assert mathml.raw_tex_left("a $x^2$ b") == ["$x^2$"]


def test_a_formula_wrapped_over_lines_is_typeset_and_a_blank_line_ends_one():
    """Markdown wraps long formulas (lectures 05 and 06: `$2^{\\lfloor \\log_2 x` / `\\rfloor - m}$`); a blank line is
    a paragraph's end, never inside a formula."""
    out = mathml.typeset("<p>the gap is $2^{\\lfloor \\log_2 x\n\\rfloor - m}$, a constant</p>"
                         "<p>$x$ and\n$y_1$</p><p>two paragraphs: $a\n\nb$</p>")
    assert out.count('display="inline"') == 3 and "lfloor" not in out and "$a\n\nb$" in out
    assert mathml.raw_tex_left("a $x\n+ y$ b") == ["$x\n+ y$"] and mathml.raw_tex_left("$a\n\nb$") == []
