"""Exercise tooling: the markers a solution carries (`markers`), exercises generated from solutions (`generate`), the student bundle (`release`), and their command line (`cli`)."""
