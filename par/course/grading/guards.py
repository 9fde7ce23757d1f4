"""Student answer files on real ranks: the exercise checks that launch jobs load them through here.

An exercise that runs on real ranks has the student write a module with `%%writefile my_ring.py`; its
check launches a job (`par.course.grading.exercise_ring`, `par.course.grading.exercise_tp`) that, on every rank,

    module = load(path)                                  # the student's file, as a fresh module
    with forbidden(COLLECTIVES, "build it from sends and receives"):
        module.ring_all_reduce(t)                        # a collective here raises, naming the rule
    with counted(torch.distributed, "all_reduce") as calls:
        ...                                              # calls["all_reduce"]: how often it was used

`forbidden` and `counted` replace module attributes for the duration of the block, so they catch
`dist.all_reduce(...)` (looked up at call time) in code loaded inside or before the block; the job
loads the student's module inside the block for `from torch.distributed import all_reduce` too.

`on_the_wire(forbid=...)` goes one level down: it replaces the collective methods of the classes every process
group is made of (`torch._C._distributed_c10d.ProcessGroup` and `Backend`), which every collective of
torch.distributed goes through, so `_get_default_group().allreduce(...)` or `pg._get_backend(dev).allreduce(...)`
are counted (and refused) too. What it guarantees: a call through torch's Python API, whatever name it was
reached by.

`refused_in_dispatcher(why)` goes below Python: it registers, in torch's operator dispatcher, a kernel that
refuses for each collective op of c10d (`c10d::allreduce_`, `c10d::alltoall_base_`, ...: DISPATCHED, on the CPU
and CUDA keys). Every process-group collective goes through these ops, whichever way it is called:
`dist.all_reduce`, `pg.allreduce`, the functional collectives (`torch.distributed._functional_collectives`),
`torch.ops.c10d.*`. Sends, receives and barriers are other ops and still work.

What none of these guarantees: the student's code runs in the same process, so a student who hunts for the
originals (a wrapper's closure, the registration object) can undo them; the grader therefore also checks
the numbers the ranks produce against its own reference (`par.course.grading.rank_io`), and the runner enters
these guards before it imports the student's module (`rank_io.main`), so what the module replaces afterwards
(`guards.on_the_wire` itself) is not what counts.
"""
from __future__ import annotations

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

# the collectives of torch.distributed (also where they are defined: distributed_c10d) and of par, which an
# exercise on sends and receives may not use
TORCH_COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather",
                     "all_gather_into_tensor", "broadcast", "all_to_all", "all_to_all_single", "scatter", "gather")
COLLECTIVES = [(module, name) for module in ("torch.distributed", "torch.distributed.distributed_c10d")
               for name in TORCH_COLLECTIVES] + \
              [("par.comm.collectives", name) for name in
               ("all_reduce", "ring_all_reduce", "reduce_scatter", "ring_reduce_scatter", "all_gather",
                "ring_all_gather", "broadcast")]


# the collective methods of a process group and of its backends (sends, receives and barriers are not among them)
WIRE_COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
                    "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single",
                    "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
                    "all_to_all_single", "broadcast", "reduce", "gather", "scatter")


# the collective ops of c10d in torch's dispatcher: what every process-group collective calls
DISPATCHED = ("allreduce_", "allreduce_coalesced_", "allgather_", "allgather_coalesced_",
              "allgather_into_tensor_coalesced_", "_allgather_base_", "reduce_scatter_", "_reduce_scatter_base_",
              "reduce_scatter_tensor_coalesced_", "alltoall_", "alltoall_base_", "broadcast_", "reduce_", "gather_",
              "scatter_")


class AnswerError(RuntimeError):
    """The student's file is missing, or it used what the exercise rules out."""


def load(path: str, name: str = "student_answer"):
    """Import the student's file as a fresh module named `name`."""
    file = Path(path)
    if not file.is_file():
        raise AnswerError(f"{path} not found in {Path.cwd()}: run the exercise's %%writefile cell first")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


GRADER = "par.course.grading"


class _GraderFinder:
    """A meta path finder that refuses every module of the grader (GRADER) with an ImportError saying why."""

    def find_spec(self, name, path=None, target=None):
        if name == GRADER or name.startswith(GRADER + "."):
            raise ImportError(f"{name} is the grader's own code: it is not available to your module during grading")
        return None


@contextmanager
def grader_hidden():
    """Within the block, the grader's modules cannot be imported, by any name (`import par.course.grading.X`,
    `importlib`, the runner's `__main__`): they are out of `sys.modules` and `par.course`'s attributes, and a
    finder refuses them. The runner's code keeps the module objects it already holds, so it runs on; the student's
    module, loaded inside the block, finds none of the grader's counts or expected values to call."""
    import types
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules)
              if name == GRADER or name.startswith(GRADER + ".")}
    main = sys.modules.get("__main__")
    runner = main is not None and getattr(main, "__spec__", None) is not None and \
        str(getattr(main.__spec__, "name", "")).startswith(GRADER + ".")
    if runner:
        sys.modules["__main__"] = types.ModuleType("__main__")
    course = sys.modules.get("par.course")
    attribute = course.__dict__.pop("grading", None) if course is not None else None
    finder = _GraderFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        if attribute is not None:
            course.grading = attribute
        if runner:
            sys.modules["__main__"] = main
        for name, module in hidden.items():
            sys.modules.setdefault(name, module)


@contextmanager
def _replaced(targets, make):
    saved = []
    try:
        for module_name, attr in targets:
            module = importlib.import_module(module_name)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, make(module_name, attr, getattr(module, attr)))
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)


@contextmanager
def forbidden(targets, why: str):
    """Within the block, calling any `(module, attribute)` of `targets` raises AnswerError saying `why`."""
    def make(module_name, attr, original):
        def refuse(*args, **kwargs):
            raise AnswerError(f"your code called {module_name}.{attr}: {why}")
        return refuse
    with _replaced(targets, make):
        yield


@contextmanager
def counted(module, *names):
    """Within the block, count the calls of `module.<name>` for each name (they still work); yields the counts."""
    calls = {name: 0 for name in names}

    def make(module_name, attr, original):
        def wrapper(*args, **kwargs):
            calls[attr] += 1
            return original(*args, **kwargs)
        return wrapper
    with _replaced([(module.__name__, name) for name in names], make):
        yield calls


@contextmanager
def on_the_wire(forbid: str | None = None):
    """Within the block, count every collective called on a process group or backend object (the methods of
    WIRE_COLLECTIVES, by name); with `forbid` (the reason), refuse them instead. Yields the counts."""
    from torch._C import _distributed_c10d as c10d
    calls = {name: 0 for name in WIRE_COLLECTIVES}
    saved = []

    def make(cls, name, original):
        def collective(self, *args, **kwargs):
            calls[name] += 1
            if forbid is not None:
                raise AnswerError(f"your code called the collective {cls.__name__}.{name}: {forbid}")
            return original(self, *args, **kwargs)
        collective.__name__ = name
        return collective
    try:
        for cls in (c10d.ProcessGroup, c10d.Backend):
            for name in WIRE_COLLECTIVES:
                original = cls.__dict__.get(name)
                if original is not None:
                    saved.append((cls, name, original))
                    setattr(cls, name, make(cls, name, original))
        yield calls
    finally:
        for cls, name, original in reversed(saved):
            setattr(cls, name, original)


@contextmanager
def refused_in_dispatcher(why: str):
    """Within the block, every collective op of c10d (DISPATCHED) raises AnswerError saying `why`, in torch's
    dispatcher: below every Python name it can be called by."""
    import warnings

    import torch
    lib = torch.library.Library("c10d", "IMPL")
    try:
        for name in DISPATCHED:
            if not hasattr(torch.ops.c10d, name):
                continue

            def refuse(*args, _name=name, **kwargs):
                raise AnswerError(f"your code called the collective c10d::{_name}: {why}")
            with warnings.catch_warnings():        # "overriding a previously registered kernel": that is the point
                warnings.simplefilter("ignore")
                for key in ("CPU", "CUDA"):
                    lib.impl(name, refuse, key)
        yield
    finally:
        lib._destroy()      # torch's own kernels again
