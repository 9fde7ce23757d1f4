"""The torchrun entry points: one file per job, each `main(argv=None)`.

A job only parses its arguments, builds what it needs from `par`, runs it and reports; the
strategies, formulas and meters live in `par` itself. Notebooks, benchmarks and tests start
jobs one way, `par.runtime.launch.run("par.measure.NAME", nproc=N, args=[...])`, which returns what
rank 0 saved with `par.runtime.dist.save_result`.

The result contract: the same key means the same quantity in every job.

    world_size   int           ranks in the job
    backend      str           "gloo" or "nccl"
    losses       [float]       loss of the whole global batch, one per step (warm-up steps included)
    step_s       [float]       wall-clock seconds of each timed step: the slowest rank's
    per_rank     [dict]        one entry per rank, gathered to rank 0 (memory, bytes, spans, ...)

`losses` and `step_s` belong to jobs that train. A job that measures something else (the collectives'
bytes and timings, ZeRO-R's activation bytes, an exercise's check on real ranks, a benchmark's timings)
reports `world_size`, `backend` and what it measured. Further keys are documented in the job's own
docstring. A job that runs several configurations in one launch saves {"world_size", "backend",
"runs": [...]}, each run with the keys above.
"""
