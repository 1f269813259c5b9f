"""examples/train.py run on the ranks of a `fusedpar.testing.World` (its process group),
as torchrun would run it, without torchrun's start: tests/project/test_examples.py and
tests/project/test_doc_commands.py call `run` through `World.run`."""

import contextlib
import io
import os
import sys

from tests.support import EXAMPLES


def run(runs: list[list[str]], cwd: str) -> list[tuple[int, str, str]]:
    """examples/train.py's `main(argv)` for each argv of `runs` in turn, on this rank, in
    the World's process group, from the directory `cwd` (relative paths such as ``--save
    ckpt`` land there): (exit code, stdout, stderr) of each. One run failing with an
    exception fails the call, as it would fail torchrun."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import train

    here, results = os.getcwd(), []
    os.chdir(cwd)
    try:
        for argv in runs:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = train.main(argv)
            results.append((code, out.getvalue(), err.getvalue()))
    finally:
        os.chdir(here)
    return results
