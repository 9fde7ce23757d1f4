"""What a grading run writes and prints: the gradebook CSV, the feedback a student reads, the class summary.

    RowWriter(path, resume)(grade)        one CSV row per finished submission, flushed at once (COLUMNS)
    write_report(grades, path)            the whole gradebook, replaced atomically
    write_feedback(grades, course, dir)   one .txt per submission: format_grade, hidden checks scrubbed
    class_summary(grades)                 statuses counted, mean per exercise

A `grade` here is a `par.course.grading.grade.Grade`, a `course` its `Course` (only their fields are read).

The gradebook is the instructor's, the feedback the student's. No cell of the gradebook reads as a formula in a
spreadsheet: a cell whose text starts with = + - @, a tab or a carriage return (OWASP's list for CSV injection),
or with the quote itself, gets a leading `'` (`escaped`), which `unescaped` removes when `--resume` reads the rows
back. Feedback never shows a hidden check's lines (`scrub`) nor the name of another student's submission: of a
flag it shows `Flag.told`.
"""
from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from par.course.authoring.markers import HIDDEN_BEGIN, HIDDEN_END
from par.runtime.checks import write_atomic

COLUMNS = ["submission", "exercise", "points", "max_points", "percent", "status", "failed_checks", "reason",
           "seconds"]
STATUSES = ("ok", "failed", "timeout", "error")
FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "'")   # what a spreadsheet may read as a formula, and the escape


def format_points(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def escaped(text) -> str:
    """The gradebook cell of `text`: with a leading `'` when it starts with one of FORMULA_START."""
    text = str(text)
    return "'" + text if text.startswith(FORMULA_START) else text


def unescaped(cell: str) -> str:
    """The text of a gradebook cell written by `escaped`."""
    return cell[1:] if cell.startswith("'") and cell[1:].startswith(FORMULA_START) else cell


def _write_row(writer: csv.DictWriter, row: dict) -> None:
    writer.writerow({k: escaped(row.get(k, "")) for k in COLUMNS})


class Flag(str):
    """A flag on a submission (a duplicate, the same answers as another student's): the text is what the gradebook
    says; `told` is what the student's feedback says, which names no other student's submission."""
    told: str

    def __new__(cls, text: str, told: str | None = None):
        flag = super().__new__(cls, text)
        flag.told = text if told is None else told
        return flag


def told(flag: str) -> str:
    """What the student reads of `flag` (a plain string, such as `unsandboxed`, as it is)."""
    return flag.told if isinstance(flag, Flag) else flag


def write_report(grades: list, path: Path, earlier: list[dict] = ()) -> None:
    """The whole gradebook at once (rows of an earlier run kept first), replacing the file atomically."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True)
    import io

    f = io.StringIO(newline="")
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    writer.writeheader()
    for row in earlier:
        _write_row(writer, row)
    for g in grades:
        _write_row(writer, g.row())
    write_atomic(path, f.getvalue())


class RowWriter:
    """Appends one row per finished submission to the report, flushed to disk at once (a killed batch keeps
    every row written); with `resume`, the rows already in the file stay (read back `unescaped`) and `done`
    holds their submissions, to be skipped."""

    def __init__(self, path: Path, resume: bool = False):
        self.path = Path(path)
        self.earlier: list[dict] = []
        if resume and self.path.exists():
            with open(self.path, newline="", encoding="utf-8") as f:
                self.earlier = [{k: unescaped(v or "") for k, v in r.items() if k in COLUMNS}
                                for r in csv.DictReader(f) if r.get("submission")]
        self.done = {r["submission"] for r in self.earlier}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_report([], self.path, self.earlier)
        self.file = open(self.path, "a", newline="", encoding="utf-8")
        self.writer = csv.DictWriter(self.file, fieldnames=COLUMNS)

    def __call__(self, g) -> None:
        _write_row(self.writer, g.row())
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def write_feedback(grades: list, course, folder: Path) -> None:
    """One text file per submission, named after its path, holding the report a student reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for g in grades:
        name = re.sub(r"[^\w.-]+", "__", str(Path(g.submission)).lstrip("./")) + ".txt"
        (folder / name).write_text(format_grade(g, course, student=True) + "\n", encoding="utf-8")


def hidden_lines(course) -> list[str]:
    """The lines of the hidden checks (what feedback must never show), longest first."""
    lines = set()
    for nb in course.notebooks.values():
        for cell in nb.cells:
            for block in re.findall(re.escape(HIDDEN_BEGIN) + r"(.*?)" + re.escape(HIDDEN_END), cell.source, re.S):
                lines |= {line.strip() for line in block.splitlines() if len(line.strip()) >= 8}
    return sorted(lines, key=len, reverse=True)


def scrub(text: str, course) -> str:
    """`text` with every line of a hidden check replaced (a student's code may have printed them)."""
    for line in hidden_lines(course) if course.official else []:
        text = text.replace(line, "[hidden check]")
    return text


# ---------------------------------------------------------------- what people read
def describe(course) -> str:
    if course.official:
        return f"official grade: the instructor's checks in {course.folder}"
    return (f"PRACTICE grade: the visible checks of {course.folder} (no solutions/ here). This is not the official "
            f"grade: your instructor grades with their own copy of the checks, hidden checks included.")


def format_grade(g, course, tracebacks: bool = True, student: bool = False) -> str:
    """The report of one notebook: the instructor's, or (`student`) what the student reads, in which every error,
    note and flag is what the student is told (`told`): no other student's submission, no message of an error
    after a check with hidden cases. Neither shows a hidden check's lines."""
    say = told if student else str
    lines = [f"{g.submission}: exercise {g.exercise or '?'} ({describe(course)})"]
    width = max([len(c.id) for c in g.checks] + [10])
    for c in g.checks:
        mark = "PASS" if c.passed else "FAIL"
        lines.append(f"  {mark}  {c.id:<{width}}  {format_points(c.points if c.passed else 0)}/{format_points(c.points)}"
                     + ("" if c.passed else f"   {say(c.error)}"))
        if not c.passed and tracebacks and say(c.traceback):
            lines += ["        " + t for t in say(c.traceback).splitlines()[-8:]]
    for note in g.notes:
        lines.append(f"  note: {say(note)}")
    pct = 100 * g.points / g.max_points if g.max_points else 0.0
    for flag in g.flags:
        lines.append(f"  flag: {say(flag)}")
    lines.append(f"{Path(g.submission).name}: {format_points(g.points)}/{format_points(g.max_points)} points ({pct:.0f}%), "
                 f"status {g.status}{': ' + say(g.reason) if g.status in ('timeout', 'error') else ''} "
                 f"[{g.seconds:.0f} s]")
    return scrub("\n".join(lines), course)


def class_summary(grades: list) -> str:
    counts = {s: sum(g.status == s for g in grades) for s in STATUSES}
    lines = [f"{len(grades)} submission(s): " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)]
    for ex in sorted({g.exercise for g in grades if g.exercise}):
        mine = [g for g in grades if g.exercise == ex and g.max_points]
        if mine:
            mean = sum(g.points / g.max_points for g in mine) / len(mine)
            lines.append(f"  {ex}: {len(mine)} graded, mean {100 * mean:.0f}%")
    return "\n".join(lines)
