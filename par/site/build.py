"""`python -m par site`: the executed course as a static website (see `par.site` for what it holds and why
nbconvert).

    python -m par site                                  # the latest run under runs/, into runs/<time>/site/
    python -m par site runs/20261126-011102 --out public/
    python -m par site --compare runs/cpu runs/gpu      # the key numbers of both runs in two columns
    python -m par site --no-reference                   # without the reference runs of docs/reference-runs/

The pages come from RUN_DIR (with --compare and no RUN_DIR: from RUN_A). Without --compare, every reference run
published in the repository (docs/reference-runs/, a GPU server's batch: see docs/ta.md) is a column of its own
beside the run's key numbers, so a reader sees the CPU numbers and the GPU ones side by side. The site is written into a folder
beside DIR and moved into place when complete, so a failed build leaves the previous site as it was; DIR must be
new, empty, or a site this command built (it holds `par-site.json`), which is replaced. Bad input is refused in
one line before any work: no run yet, a folder that is not a run, an output folder that cannot be written or
holds something else.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

from par.runtime.checks import check_writable
from par.site import pages, theme
from par.site.exercises import ROOT, student_exercises
from par.site.run import BatchRun, SiteError, latest, load, reference_runs

MARKER = "par-site.json"
# the docs/ pages in the header, in this order (others follow by name, labelled by their title)
DOC_LABELS = {"instructor": "Instructors", "ta": "TAs", "cluster": "Cluster"}


def prepare_target(out: Path, runs: list[BatchRun]) -> None:
    """Refuse an output folder that is not new, empty, or an earlier site (so a typo never deletes a folder)."""
    out = out.absolute()
    for run in runs:
        if out == run.folder.absolute() or out in run.folder.absolute().parents:
            raise SiteError(f"--out {out} would replace the run {run.folder} itself; choose a folder beside it "
                            f"(default: {run.folder / 'site'})")
    if out.exists() and not out.is_dir():
        raise SiteError(f"--out {out} is a file; choose a folder for the site")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise SiteError(f"--out {out} holds files of something else (no {MARKER}); choose a new or empty folder")
    check_writable(out, directory=True)


def docs_of(root: Path) -> list[tuple[str, Path]]:
    """(stem, path) of docs/*.md: the known pages first, in DOC_LABELS' order."""
    found = {p.stem: p for p in sorted((root / "docs").glob("*.md"))}
    order = [s for s in DOC_LABELS if s in found] + [s for s in found if s not in DOC_LABELS]
    return [(s, found[s]) for s in order]


def write(path: Path, text: str) -> None:
    """One file of the site being built; a write the disk refuses (full: ENOSPC) is a SiteError naming it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise SiteError(f"cannot write the site's {path.name} in {path.parent}: {e.strerror or e}; free some space "
                        f"or choose another --out (the previous site is left as it was)") from None


def read_notebook(source: Path):
    """An executed (or source) notebook, or a SiteError naming it when it is not one (truncated by a full disk)."""
    import nbformat
    try:
        return nbformat.read(source, as_version=4)
    except Exception as e:   # nbformat raises NotJSONError, ValidationError, UnicodeDecodeError, ...
        raise SiteError(f"{source} is not a readable notebook ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}); "
                        f"run that notebook again (python -m par batch --notebooks notebooks/{source.name}) or "
                        f"delete it") from None


def build(run_dir: Path | None = None, out: Path | None = None, compare: tuple[Path, Path] | None = None,
          mathjax_url: str | None = theme.MATHJAX_URL, root: Path = ROOT, runs_root: Path = Path("runs"),
          exercises: dict[str, str] | None = None, references: list[Path] | None = None) -> dict:
    """Write the site; return what `par-site.json` records (pages, seconds; the runs by folder name there, by
    path here) and `out`. `exercises`: {file name: notebook text} of the student exercises (default: released
    now from `root`, see `par.site.exercises`). `references`: the reference runs shown beside the run when there is
    no `compare` (default: `reference_runs(root)`; [] for none)."""
    import nbformat

    start = time.perf_counter()
    compared = [load(compare[0]), load(compare[1])] if compare else []
    run = load(run_dir) if run_dir else (compared[0] if compared else load(latest(runs_root)))
    if not compared:
        compared = [run] + [replace(load(p), reference=True) for p in
                            (reference_runs(root) if references is None else references)]
        compared = compared if len(compared) > 1 else []
    runs = compared or [run]                       # the columns of key numbers
    others = [r for r in compared if r.folder.resolve() != run.folder.resolve()]
    out = Path(out) if out else run.folder / "site"
    prepare_target(out, [run, *compared])
    student = student_exercises(root) if exercises is None else exercises   # may refuse (a release that fails)

    tmp = out.absolute().parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        exporter = pages.exporter()
        provenance = pages.provenance_html(run, others)
        docs = docs_of(root)
        doc_pages = [(DOC_LABELS.get(stem) or pages.markdown_title(path.read_text(), stem), f"docs/{stem}.html")
                     for stem, path in docs]
        nav = [("Syllabus", "index.html"), ("Exercises", "index.html#exercises"), *doc_pages]
        written: list[str] = []

        def emit(rel: str, title: str, body: str) -> None:
            write(tmp / rel, pages.page(title=title, body=body, depth=rel.count("/"), nav=nav, here=rel,
                                        provenance=provenance, mathjax_url=mathjax_url))
            written.append(rel)

        write(tmp / "style.css", theme.stylesheet())

        # lectures
        executed, titles = {}, {}
        for lecture in run.lectures:
            source = lecture.path or (root / "notebooks" / f"{lecture.stem}.ipynb")
            nb = read_notebook(source) if source.is_file() else None
            executed[lecture.stem] = nb if lecture.path else None
            titles[lecture.stem] = pages.title_of(nb, lecture.stem) if nb is not None else lecture.stem
        exercise_of = {name.split("_", 1)[0]: Path(name).stem for name in student}
        order = run.lectures
        for i, lecture in enumerate(order):
            nb = executed[lecture.stem]
            prev = (order[i - 1].stem, titles[order[i - 1].stem]) if i else None
            nxt = (order[i + 1].stem, titles[order[i + 1].stem]) if i + 1 < len(order) else None
            body = pages.lecture_body(lecture, titles[lecture.stem],
                                      pages.notebook_body(nb, exporter) if nb is not None else None,
                                      runs, prev, nxt, exercise_of.get(lecture.exercise_number))
            emit(f"lectures/{lecture.stem}.html", titles[lecture.stem], body)

        # exercises, as students get them
        for name, text in student.items():
            nb = nbformat.reads(text, as_version=4)
            emit(f"exercises/{Path(name).stem}.html", pages.title_of(nb, Path(name).stem),
                 pages.exercise_body(name, pages.notebook_body(nb, exporter)))

        # docs/*.md; a link to another doc or to the README becomes a link to its page
        links = {f"{stem}.md": f"{stem}.html" for stem, _ in docs}
        links["../README.md"] = "../index.html"
        for stem, path in docs:
            text = path.read_text(encoding="utf-8")
            emit(f"docs/{stem}.html", pages.markdown_title(text, stem), pages.markdown_html(text, links))

        # the index
        in_course = sorted(p.stem for p in (root / "notebooks").glob("*.ipynb"))
        missing = [s for s in in_course if run.lecture(s) is None]
        body = pages.index_body(run, runs, titles, exercise_of, doc_pages, missing)
        emit("index.html", "Syllabus", body)

        info = {"built": datetime.now().astimezone().isoformat(timespec="seconds"), "run": run.folder.name,
                "compare": [r.folder.name for r in compared], "provenance": run.provenance,
                "pages": sorted(written), "mathjax": mathjax_url or None,
                "seconds": round(time.perf_counter() - start, 2)}
        write(tmp / MARKER, json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {**info, "run": str(run.folder), "compare": [str(r.folder) for r in compared], "out": str(out)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m par site", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", nargs="?", type=Path, default=None, metavar="RUN_DIR",
                        help="a folder `python -m par batch` wrote (default: the latest under runs/)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="the site's folder (default: RUN_DIR/site)")
    parser.add_argument("--compare", nargs=2, type=Path, default=None, metavar=("RUN_A", "RUN_B"),
                        help="show the key numbers of two runs side by side (e.g. a CPU run and a GPU run)")
    parser.add_argument("--no-reference", action="store_true",
                        help="leave out the reference runs of docs/reference-runs/ (shown beside the run by default)")
    parser.add_argument("--mathjax", default=theme.MATHJAX_URL, metavar="URL",
                        help="a MathJax 3 script that typesets the formulas in the reader's browser instead (default: "
                             "none; formulas are MathML, typeset when the site is built, and need no network)")
    args = parser.parse_args(argv)
    info = build(args.run, args.out, tuple(args.compare) if args.compare else None, args.mathjax or None,
                 references=[] if args.no_reference else None)
    counts = {kind: sum(p.startswith(kind) for p in info["pages"]) for kind in ("lectures/", "exercises/", "docs/")}
    print(f"wrote the site of {info['run']} to {info['out']}: the syllabus, {counts['lectures/']} lectures, "
          f"{counts['exercises/']} exercises, {counts['docs/']} docs pages in {info['seconds']:.1f} s")
    print(f"open {Path(info['out']) / 'index.html'} in a browser, or copy the folder to any static host "
          f"(GitHub Pages, a web server's folder)")
    return 0
