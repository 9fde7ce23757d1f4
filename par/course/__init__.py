"""Course tooling, not a concept: the lectures' launches as data, the dry run, running notebooks, exercises, release, grading, plots."""
