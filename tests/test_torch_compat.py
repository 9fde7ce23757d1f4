"""`python -m par torch-compat`: every torch name par uses, looked up in another release's sources (not imported)."""
import zipfile

from par.course.server import torch_compat as tc
from par.runtime.paths import ROOT

PAR_MODULE = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as ckpt

def f(x):
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return F.scaled_dot_product_attention(x, x, x, is_causal=True) + torch.log(x).sum() + ckpt(f, x)
"""


def release(path, files: dict) -> tc.Source:
    """A fake torch wheel holding `files` ({path: text})."""
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return tc.Source(path)


NEW = {"torch/__init__.py": "    from torch._C._VariableFunctions import *  # noqa\n",
       "torch/version.py": "__version__ = '9.1.0'\n",
       "torch/_C/_VariableFunctions.pyi": "def log(x): ...\n",
       "torch/distributed/__init__.py": "from .distributed_c10d import *\n",
       "torch/distributed/distributed_c10d.py": "class ReduceOp: SUM = 0\ndef all_reduce(t, op): ...\n",
       "torch/nn/__init__.py": "", "torch/nn/functional.py": "def scaled_dot_product_attention(q, k, v): ...\n",
       "torch/utils/__init__.py": "", "torch/utils/checkpoint.py": "def checkpoint(fn, *a): ...\n"}


def test_the_names_a_module_uses_follow_its_aliases():
    names = {u.name for u in tc.used_in(PAR_MODULE, "par/x.py")}
    assert {"torch.distributed.all_reduce", "torch.distributed.ReduceOp.SUM", "torch.log",
            "torch.nn.functional.scaled_dot_product_attention", "torch.utils.checkpoint.checkpoint"} <= names


def test_a_name_the_other_release_lacks_is_missing_with_where_par_uses_it(tmp_path):
    new = release(tmp_path / "new.whl", NEW)
    old = release(tmp_path / "old.whl", {**NEW, "torch/nn/functional.py": "def relu(x): ...\n",
                                         "torch/version.py": "__version__ = '9.0.0'\n"})
    names = {u.name: u.where for u in tc.used_in(PAR_MODULE, "par/x.py")}
    gone, checked, undecided = tc.missing(names, new, old)
    assert [n for n, _ in gone] == ["torch.nn.functional.scaled_dot_product_attention"]
    assert gone[0][1] == "par/x.py:9" and checked == len(names) and undecided == 0
    assert (old.version(), new.version()) == ("9.0.0", "9.1.0")
    assert tc.missing(names, new, new)[0] == []


def test_a_name_made_at_run_time_is_undecided_not_missing(tmp_path):
    new = release(tmp_path / "new.whl", NEW)
    gone, checked, undecided = tc.missing({"torch.made_later": "par/x.py:1"}, new, new)
    assert (gone, checked, undecided) == ([], 0, 1)


def test_every_torch_name_par_uses_is_decided_in_the_installed_torch():
    names = tc.used_names(ROOT / "par")
    installed = tc.Source(tc.installed_torch())
    assert len(names) > 100 and all(tc.defines(installed, n) for n in names), \
        [n for n in names if not tc.defines(installed, n)]
    assert tc.defines(installed, "torch.nn.functional.no_such_function_anywhere") is False


def test_not_a_wheel_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "x.whl").write_text("not a zip")
    assert tc.main([str(tmp_path / "x.whl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "pip download --no-deps torch==2.11.0" in err
