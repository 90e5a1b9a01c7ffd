"""The rows of ``rl-kernels repro``'s table, read back from its output for the tests: each row's
cells by column, its note resolved from the numbered notes under the table."""
import re

COLUMNS = ("sample", "backend", "log_probs", "entropy", "result", "note")


def table_rows(out: str) -> list[dict]:
    """One dict per table row of ``out`` (keys :data:`COLUMNS`); ``note`` is the note's text ('' for none)."""
    lines = out.splitlines()
    notes = {}
    for line in lines:
        match = re.fullmatch(r"\[(\d+)\] (.*)", line)
        if match:
            notes[f"[{match.group(1)}]"] = match.group(2)
    rows = []
    for line in [line for line in lines if line.startswith("| ")][1:]:  # after the header
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert len(cells) == len(COLUMNS), line
        row = dict(zip(COLUMNS, cells))
        row["note"] = notes[row["note"]] if row["note"] else ""
        rows.append(row)
    return rows
