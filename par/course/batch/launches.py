"""The launch engine: every job a lecture notebook starts is one `Launch`, found from the lecture modules.

A `Launch` is one `par.runtime.launch.run` a notebook makes: the job's module, the number of ranks, the job's
typed arguments (its `Args`, e.g. `par.dp.job.Args`: a notebook reads `job.args.batch`), the backend, the timeout,
and what it computes (`work`: the job's own `work(args, nproc)`, beside its `Args`, in the planner's terms of
`par.runtime.job_work`), its timeout scaled with that work (`par.course.batch.cost.scaled_timeout`).

The lectures are found, not listed: `lectures()` imports every `lNN_topic.py` of `par/course/lectures/` (and of the
folders in $PAR_LECTURES, or `extra`) and keys it by its NOTEBOOK (`par/course/lectures/__init__.py` says what a
lecture module declares); the functions below take `known` instead where a test brings its own. The engine imports
no lecture by name: the lectures build on it, it finds them.

    launches(notebook, world_size, backend, preset, steps)   a notebook's launches, a pure function of the
                                                              batch's four parameters (the notebook runs exactly
                                                              those: `launch.run()`; the dry run checks them)
    find(notebook, cell, ...)                                 the launches of one cell
    kernel_work(notebook, ...), in_kernel(notebook, cell, ...)   what a notebook computes in its own kernel
                                                              (`KernelWork`), sized by the same parameters
    notebook_timeout(launches)                                the batch's cell timeout for a notebook

The dry run that checks them for a GPU server is `par.course.batch.dry_run`.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import ModuleType

import par.runtime.launch
from par.course.batch import cost
from par.course.batch.cost import CELL_TIMEOUT_S, NOTEBOOK_S
from par.measure import parse
from par.memory.accounting import format_bytes, param_count
from par.runtime.job_args import JobArgs
from par.runtime.job_work import Training


class CourseError(ValueError):
    """A notebook, cell or job the lectures do not know, or a lecture module that is not one."""


@dataclass(frozen=True, kw_only=True)
class Launch:
    """One `par.runtime.launch.run` a notebook makes: the job's module and its typed arguments (`args`, the
    job's `Args`: `job.args.batch`), the ranks, backend and timeout, and what it computes (`work`, in order)."""
    notebook: str
    cell: str                        # which part of the notebook (the launches of one cell share it)
    module: str
    nproc: int
    args: JobArgs
    backend: str
    timeout: float
    work: tuple = field(default_factory=tuple)

    def run(self, show: bool = True, **kwargs):
        """Run it: `par.runtime.launch.run` with exactly these parameters (quiet=..., env=... pass through).
        `show`: first print the one-line command (what a student would type), so the notebook says what runs.
        Returns rank 0's result parsed once into the job's own typed `Result` (`par.measure.parse`, e.g.
        `par.dp.job.Result`: `result.runs[0].losses`)."""
        if show:
            print(f"$ {self.command()}")
        result = par.runtime.launch.run(self.module, nproc=self.nproc, args=self.args.to_argv(), backend=self.backend,
                                        timeout=self.timeout, **kwargs)
        return parse(result, self.module)

    def command(self) -> str:
        """The launch as a shell command: `torchrun --nproc-per-node=N -m module args...`."""
        return shlex.join(["torchrun", f"--nproc-per-node={self.nproc}", "-m", self.module, *self.args.to_argv()])

    def with_args(self, **changes) -> Launch:
        """The launch with some arguments changed (e.g. `with_args(dtype=("fp32", "fp16"))` on a GPU without bf16)."""
        return replace(self, args=replace(self.args, **changes))

    def fill(self, **values) -> Launch:
        """The launch with `{name}` placeholders in its text arguments filled in (e.g. a temporary directory)."""
        text = {f.name: getattr(self.args, f.name) for f in fields(self.args)}
        return self.with_args(**{k: v.format(**values) for k, v in text.items() if isinstance(v, str) and "{" in v})

    def name(self) -> str:
        return f"{self.notebook} [{self.cell}] {self.module} on {self.nproc} rank{'s' if self.nproc > 1 else ''}"


def launch(notebook: str, cell: str, nproc: int, args: JobArgs, backend: str, timeout: float | None = None) -> Launch:
    """A Launch of the job whose `Args` `args` are: its work from the job's own `work(args, nproc)`, its timeout
    scaled with that work (unless given)."""
    module = type(args).__module__
    work_of = getattr(importlib.import_module(module), "work", None)
    if work_of is None:
        raise CourseError(f"{module} has no work(args, nproc) beside its Args: the dry run cannot cost it")
    done = tuple(work_of(args, nproc))
    return Launch(notebook=notebook, cell=cell, module=module, nproc=nproc, args=args, backend=backend,
                  timeout=timeout if timeout is not None else cost.scaled_timeout(done, backend, nproc), work=done)


# ---------------------------------------------------------------- the lectures, found
LECTURES = Path(__file__).resolve().parent.parent / "lectures"
LECTURE_FILE = re.compile(r"^l\d+[a-z]?_\w+\.py$")      # l03_pipelines.py, l07b_at_scale.py
DECLARED = ("NOTEBOOK", "CELLS", "launches", "KEY_NUMBERS")


def lecture_folders(extra=None) -> list[Path]:
    """par/course/lectures/, then the folders of $PAR_LECTURES (os.pathsep-separated), then `extra`."""
    env = [Path(p) for p in os.environ.get("PAR_LECTURES", "").split(os.pathsep) if p]
    return [LECTURES, *env, *(Path(p) for p in (extra or ()))]


def _load(path: Path) -> ModuleType:
    if path.parent == LECTURES:
        return importlib.import_module(f"par.course.lectures.{path.stem}")
    spec = importlib.util.spec_from_file_location(f"par_lecture_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lectures(extra=None) -> dict[str, ModuleType]:
    """{notebook name: its lecture module}, in notebook order: every `lNN_topic.py` of `lecture_folders(extra)`."""
    found: dict[str, ModuleType] = {}
    for folder in lecture_folders(extra):
        for path in sorted(Path(folder).glob("l*_*.py")):
            if not LECTURE_FILE.match(path.name):
                continue
            module = _load(path)
            missing = [name for name in DECLARED if not hasattr(module, name)]
            if missing:
                raise CourseError(f"{path} is not a lecture module: it lacks {', '.join(missing)} "
                                  f"(see par/course/lectures/__init__.py)")
            if module.NOTEBOOK in found:
                raise CourseError(f"{path} and {found[module.NOTEBOOK].__file__} are both lecture "
                                  f"{module.NOTEBOOK!r}: one module per notebook")
            found[module.NOTEBOOK] = module
    return dict(sorted(found.items()))


def lecture(notebook: str, known: dict | None = None) -> ModuleType:
    """The lecture module of `notebook` (a name such as "03_pipelines", or a path), among `known` ({notebook:
    module}, default `lectures()`: a test passes its own)."""
    key = notebook.rsplit("/", 1)[-1].removesuffix(".ipynb")
    known = lectures() if known is None else known
    if key not in known:
        raise CourseError(f"no lecture module for notebook {key!r}: known are {', '.join(known)} "
                          f"(a lecture is par/course/lectures/lNN_topic.py with NOTEBOOK = {key!r})")
    return known[key]


def launches(notebook: str, world_size: int, backend: str = "auto", preset: str = "tiny", steps: int = 20,
             known: dict | None = None) -> list[Launch]:
    """Every launch `notebook` makes with these parameters (a name such as "03_pipelines", or a path)."""
    return lecture(notebook, known).launches(world_size, backend, preset, steps)


def find(notebook: str, cell: str, world_size: int, backend: str = "auto", preset: str = "tiny",
         steps: int = 20) -> list[Launch]:
    """The launches of one cell of a notebook (what that cell should run, in order; [] where the cell
    launches nothing at these parameters). A cell name the lecture does not declare is an error."""
    cells = lecture(notebook).CELLS
    if cell not in cells:
        raise CourseError(f"{notebook} has no cell {cell!r}: its cells are {', '.join(cells)}")
    return [l for l in launches(notebook, world_size, backend, preset, steps) if l.cell == cell]


def notebook_timeout(found: list[Launch]) -> float:
    """The cell timeout a batch should give a notebook: its busiest cell's launch timeouts + NOTEBOOK_S."""
    cells: dict = {}
    for l in found:
        cells[l.cell] = cells.get(l.cell, 0.0) + l.timeout
    return max(CELL_TIMEOUT_S, max(cells.values(), default=0.0) + NOTEBOOK_S)


# ---------------------------------------------------------------- work a notebook does in its own kernel
KERNEL_MEMORY = 8e9     # the most an in-kernel demo or reference is sized to (a laptop's share of its memory)
MIN_TOKENS = 128        # a demo shortens its sequences down to this before it is skipped


@dataclass(frozen=True, kw_only=True)
class KernelWork:
    """Work a notebook does in its own process (the Jupyter kernel), not in a launched job: a demo, or a
    single-process reference. A lecture's `kernel` sizes it from the batch's four parameters, as its `launches`
    sizes the jobs, so the notebook runs it at that size and the dry run checks exactly that.

    batch, tokens   `batch` sequences of `tokens` tokens (<= model.block_size) of `model`, the model the notebook
                    builds; a demo halves them until `memory()` <= KERNEL_MEMORY (`sized`)
    device          where its tensors live: "gpu" (cuda:0 of a GPU server) or "host" (the CPU's memory)
    memory()        the planner's peak of `steps` steps of `batch` x `tokens` in `precision` with `optimizer`
                    (sgd: forward and backward only, no optimizer state) + `states` bytes per parameter of the
                    other models the notebook keeps alive meanwhile (an fp32 model and its gradients: 8)
    skipped         why it does not run at these parameters ("" when it runs): the notebook prints it"""
    notebook: str
    cell: str
    model: object            # par.model.GPTConfig
    batch: int
    tokens: int
    device: str              # gpu | host
    label: str = ""          # the model in a few words ('gpt3-small')
    precision: str = "fp32"
    optimizer: str = "sgd"
    steps: int = 1
    states: float = 0.0
    skipped: str = ""

    def training(self) -> Training:
        """The work in the planner's terms (the model's context cut to `tokens`)."""
        return Training(model=replace(self.model, block_size=self.tokens), global_batch=self.batch,
                        precision=self.precision, optimizer=self.optimizer, steps=self.steps, label=self.cell)

    def memory(self) -> float:
        """Predicted bytes at the peak, on `device` (whether or not it is skipped)."""
        return cost.memory(self.training(), cost.cpu()) + self.states * param_count(self.model)

    def name(self) -> str:
        return f"{self.notebook} [{self.cell}] in the notebook's kernel"

    def describe(self) -> str:
        return f"{self.batch} x {self.tokens} tokens of {self.label or 'GPT-lite'} on the {self.device}"


def sized(notebook: str, cell: str, model, batch: int, device: str, shrink: bool = True, **fields_) -> KernelWork:
    """`batch` sequences of the model's whole context, halved (the batch first, then the tokens down to
    MIN_TOKENS) until the work fits KERNEL_MEMORY; skipped, with the reason, where even the smallest does not
    fit, or at once where `shrink` is False (a reference must see the batches of the job it checks)."""
    work = KernelWork(notebook=notebook, cell=cell, model=model, batch=batch, tokens=model.block_size, device=device,
                      **fields_)
    while shrink and work.memory() > KERNEL_MEMORY and (work.batch > 1 or work.tokens > MIN_TOKENS):
        work = replace(work, batch=work.batch // 2) if work.batch > 1 else \
            replace(work, tokens=max(MIN_TOKENS, work.tokens // 2))
    if work.memory() > KERNEL_MEMORY:
        return replace(work, skipped=f"{work.describe()} would need {format_bytes(work.memory())} in the "
                                     f"notebook's kernel, more than the {format_bytes(KERNEL_MEMORY)} that in-kernel "
                                     f"work may take (par.course.batch.launches.KERNEL_MEMORY)")
    return work


def kernel_work(notebook: str, world_size: int, backend: str = "auto", preset: str = "tiny", steps: int = 20,
                known: dict | None = None) -> list[KernelWork]:
    """What `notebook` computes in its own kernel with these parameters ([] for a lecture without `kernel`)."""
    kernel = getattr(lecture(notebook, known), "kernel", None)
    return kernel(world_size, backend, preset, steps) if kernel else []


def in_kernel(notebook: str, cell: str, world_size: int, backend: str = "auto", preset: str = "tiny",
              steps: int = 20) -> KernelWork:
    """The in-kernel work of one cell of a notebook, sized for these parameters (`skipped` says why it does not run)."""
    found = [k for k in kernel_work(notebook, world_size, backend, preset, steps) if k.cell == cell]
    if len(found) != 1:
        known = ", ".join(k.cell for k in kernel_work(notebook, world_size, backend, preset, steps)) or "none"
        raise CourseError(f"{notebook} has no in-kernel work {cell!r}; it has: {known}")
    return found[0]
