"""`par.course.show`: the lectures print par's own code, whole, with where it lives (no ranks, no notebooks)."""
import inspect

import pytest

from par.comm import collectives
from par.course.show import Shown, markdown_text, show, source, source_text
from par.dp.bucketed import Bucket, BucketedDP
from par.tp import ops as tp_ops


def test_a_function_is_shown_whole_with_its_place():
    name, where, code = source(collectives._ring_reduce_scatter)
    assert name == "par.comm.collectives._ring_reduce_scatter"
    line = inspect.getsourcelines(collectives._ring_reduce_scatter)[1]
    assert where == f"par/comm/collectives.py:{line}"
    assert code.startswith("def _ring_reduce_scatter(") and code.endswith("return sent")
    assert code == inspect.getsource(collectives._ring_reduce_scatter).rstrip("\n")
    assert "..." not in code


def test_methods_are_dedented_and_named_by_class():
    name, _, code = source(BucketedDP._end_of_backward)
    assert name == "par.dp.bucketed.BucketedDP._end_of_backward"
    assert code.startswith("def _end_of_backward(self)")
    assert "\n        b.pending.wait()" in code and "\n            b.pending.wait()" not in code   # one level less
    _, _, prop = source(Bucket.nbytes)                        # a property: its getter
    assert "def nbytes(self)" in prop
    name, _, cls = source(tp_ops._CopyToRegion)               # a class, with its static methods
    assert name == "par.tp.ops._CopyToRegion" and cls.startswith("class _CopyToRegion(")
    assert "def backward(ctx, grad):" in cls


def test_texts_hold_every_object_and_the_formula():
    text = source_text(collectives.reduce_scatter_chunks, collectives.all_gather_chunks, formula="2(N-1)/N·S")
    assert text.startswith("formula: 2(N-1)/N·S")
    assert "# par.comm.collectives.reduce_scatter_chunks  (par/comm/collectives.py:" in text
    assert "def all_gather_chunks(" in text
    md = markdown_text(collectives.all_gather_chunks, formula=r"\frac{N-1}{N}")
    assert md.startswith(r"$$\frac{N-1}{N}$$") and "```python\ndef all_gather_chunks(" in md and md.endswith("```")


def test_a_fence_longer_than_any_backticks_in_the_code():
    def quoted():
        return "```"     # a fence inside the code must not close the block
    md = markdown_text(quoted)
    assert "````python\n" in md and md.endswith("\n````")


def test_no_source_is_an_error_not_an_empty_listing():
    with pytest.raises(TypeError, match="no Python source"):
        source(len)
    with pytest.raises(TypeError):
        show()


def test_outside_ipython_it_prints_the_plain_text(capsys):
    show(collectives.all_gather_chunks)
    out = capsys.readouterr().out
    assert out.strip() == source_text(collectives.all_gather_chunks)
    shown = Shown(collectives.all_gather_chunks)
    assert repr(shown) == shown.text and shown._repr_markdown_() == shown.markdown
