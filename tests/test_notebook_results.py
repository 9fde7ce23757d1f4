"""No lecture notebook reads a job's result by string key: a launch returns a typed `par.measure.JobResult`, read
as attributes (`run.losses`, `result.find(label="3").memory`, `run.rank(0).bytes`).

A static scan of every code cell of notebooks/*.ipynb (their Python syntax tree): it flags
- a subscript by one of the result's names (`x["runs"]`, `r["losses"]`, `R["0"]["step_s"]`, `run["timeline"]`, ...),
  `.get(...)` of one of them too;
- a subscript by text of what a launch returned (`job.run()["anything"]`);
- a run picked by a label and then read by key (`R["0"]["anything"]`);
- a test of a result's name by `in` (`"timeline" in run`: a result is no mapping, `run.has("timeline")`).
A notebook's own dicts (a figure's curves keyed by name, a library's `{"x": ..., "y": ...}`) use other keys and
pass; `test_the_scan_flags_the_old_way` shows each pattern caught.
"""
from __future__ import annotations

import ast
import json

import pytest

from par.runtime.paths import ROOT

# the contract's names (par.measure) and the result names notebooks read most: no notebook dict uses them as keys
RESULT_NAMES = {"runs", "losses", "step_s", "per_rank", "world_size", "backend", "timeline", "spans", "memory",
                "max_diff", "max_param_diff", "max_grad_diff", "max_loss_diff", "bubble", "torch_api", "per_layer",
                "bytes_per_step", "bytes_sent_per_step", "dense_losses", "sp_losses", "cp_losses", "losses_torch",
                "alltoall_bytes", "tokens_per_expert", "calibration", "trace", "timing", "modes"}


def text_key(node) -> str | None:
    """The key of `x["key"]` (None for any other subscript)."""
    return node.slice.value if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str) else None


def string_reads(source: str) -> list[str]:
    """Every read of a result by string key in one code cell, as `line N: <code>`."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    found = []
    for node in ast.walk(ast.parse(code)):
        key = None
        if isinstance(node, ast.Subscript) and (key := text_key(node)) is not None:
            launched = isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute) \
                and node.value.func.attr == "run"
            picked = isinstance(node.value, ast.Subscript) and (text_key(node.value) or "").isdigit()
            if key in RESULT_NAMES or launched or picked:
                found.append(f"line {node.lineno}: {ast.get_source_segment(code, node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in RESULT_NAMES:
            found.append(f"line {node.lineno}: {ast.get_source_segment(code, node)}")
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and node.left.value in RESULT_NAMES \
                and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            found.append(f"line {node.lineno}: {ast.get_source_segment(code, node)}")
    return found


def test_the_scan_flags_the_old_way():
    old = ['runs = timeline_job.run(quiet=True)["runs"]', 'plots.gantt(run["timeline"])', 'r["runs"][0]["losses"]',
           'R["0"]["losses"]', 'R["3+offload"]["memory"]', 'result = job.run()["numel"]', 'x = R["1"]["bytes_total"]',
           'print(f"{result[\'world_size\']} ranks")', 'run.get("per_rank", [])',
           'if "timeline" in run: pass']
    for line in old:
        assert string_reads(line), line
    fine = ['curves = {"dense": result.losses}', 'curves["FSDP2"] = run_of("fsdp2").losses', 'med["3"] / med["2"]',
            'ys["x"], ys["y"]', 'run.find(label="0").losses', 'runs["fp32 adam"].measured[0].total',
            'bubble_all.setdefault(name, {})[m] = {"measured": r.bubble}', '%matplotlib inline',
            'if run.has("timeline"): pass', 'if "fp32" in dtypes: pass']
    for line in fine:
        assert not string_reads(line), line


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_notebook_reads_a_result_by_string_key(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    found = [f"cell {i}, {hit}" for i, c in enumerate(cells) for hit in string_reads("".join(c["source"]))]
    assert not found, f"{path.name} reads results by string key (read attributes: run.losses):\n" + "\n".join(found)
