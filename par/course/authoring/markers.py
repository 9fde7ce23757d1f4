"""The markers a solution notebook carries, shared by everything that reads or writes exercises.

    ### BEGIN SOLUTION / ### END SOLUTION          an answer region: stubbed to STUB in the exercise
    ### BEGIN HIDDEN CHECKS / ### END HIDDEN CHECKS  hidden checks: replaced by HIDDEN_NOTE in the exercise
    tag "check"                                     a check cell: its asserts decide the grade
    cell id NOTE_ID                                 the note the generator puts on top of an exercise

`par.course.authoring.generate` generates exercises with them, `par.course.authoring.release` refuses a bundle that still
holds one, `par.course.grading.grade` skips the generated note.
"""
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = 'raise NotImplementedError("your code here")'
HIDDEN_BEGIN = "### BEGIN HIDDEN CHECKS"
HIDDEN_END = "### END HIDDEN CHECKS"
HIDDEN_NOTE = "# (hidden checks: they run when your instructor grades this notebook)"
CHECK = "check"
NOTE_ID = "par-generated-note"

# every marker whose presence in a notebook gives an answer or a hidden check away
LEAKING = (BEGIN, END, HIDDEN_BEGIN, HIDDEN_END)
