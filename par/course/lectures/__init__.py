"""One module per lecture notebook: everything the course knows about that lecture, in one file read top to bottom.

A lecture module is named `lNN_topic.py` (`l03_pipelines.py` for notebooks/03_pipelines.ipynb) and holds, in this
order:

    NOTEBOOK        the notebook's name without `.ipynb` ("03_pipelines"): the lecture's key everywhere
    CELLS           the names of the notebook's cells that launch, in order (`course.find(NOTEBOOK, cell, ...)`);
                    a cell may launch nothing at some parameters, never use a name that is not here
    launches(world_size, backend, preset, steps) -> list[Launch]
                    every job the notebook starts at the batch's four parameters, each one
                    `par.course.batch.launches.launch(NOTEBOOK, cell, nproc, <the job's Args>, backend)`: what it
                    computes and costs comes from the job's own `work(args, nproc)` beside its `Args`
    kernel(world_size, backend, preset, steps) -> list[KernelWork]      (only where the notebook computes in
                    its own process: `par.course.batch.launches.sized(...)`, a demo shrunk to fit, or skipped)
    KEY_NUMBERS     what a reader should see first, each a `par.site.numbers.Key`: what it is, its formula, the
                    record the notebook writes (`record(name, value)`), and its target where the lecture states
                    one (`at_most(1e-5)`, `near(1.0, 0.05)`, `equal(16)`): the site shows the verdict, and
                    `python -m par.course.lectures --verdicts RUN_DIR` holds a run to them (exit 1 where one is missed)
    figures         the plots only this lecture draws (shared ones are in `par.course.plots`)

Nothing else lists the lectures: the launch engine (`par.course.batch.launches.lectures`) finds every `lNN_*.py`
here and keys it by its NOTEBOOK, and the batch, its dry run (`python -m par batch --dry-run`), `course.find` and
the site's key numbers (`python -m par.course.lectures`, the command the site calls) all ask it. The modules build
on the engine (`launch`, `sized`) and on `par.course.batch.cost`; the engine imports none of them by name.

To add lecture 10: write notebooks/10_topic.ipynb, copy the smallest module (`l04_tensor_parallel.py`) to
`l10_topic.py` and change NOTEBOOK, CELLS, `launches` and KEY_NUMBERS; the README's "Adding a lecture" lists the
rest (the concept package, the exercise, the tests).

A folder of further lecture modules (a lecture being written, a test's throw-away lecture) is added with the
environment variable PAR_LECTURES (folders separated by os.pathsep), or `lectures(extra=[folder])`.
"""
