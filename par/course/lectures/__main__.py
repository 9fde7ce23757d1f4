"""`python -m par.course.lectures`: every lecture's key numbers and their targets as JSON, {notebook: [key]}.

The site (`par.site.numbers.lecture_keys`) calls it as a command: the course tooling stays a layer nothing imports."""
import json
import sys

from par.course.batch.launches import lectures


def key_numbers(extra=None) -> dict[str, list[dict]]:
    """{notebook name: its key numbers as plain data (`par.site.numbers.Key.to_dict`)}."""
    return {name: [k.to_dict() for k in module.KEY_NUMBERS] for name, module in lectures(extra).items()}


if __name__ == "__main__":
    json.dump(key_numbers(), sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
