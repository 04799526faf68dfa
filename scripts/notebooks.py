"""Executes teaching notebooks top to bottom: `python scripts/notebooks.py notebooks/*.ipynb` (`make notebooks`)
rewrites each in place with its fresh outputs, which is what is committed; tests/test_notebooks.py runs the
same `execute` on a copy and fails on any error.

Each notebook runs in a fresh kernel (the current Python's, `python3`) with its own folder as the working
directory, so it reads the benchmark results as ../benchmarks/results/.
"""

import os
import sys
import time

import nbclient
import nbformat

TIMEOUT = 600  # seconds a cell may run: notebooks 1-4 take under 3 minutes in all, 5 under 6


def execute(path):
    """The notebook at `path`, executed: (the executed notebook, seconds it took); raises
    nbclient.exceptions.CellExecutionError naming the cell on the first error."""
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    client = nbclient.NotebookClient(notebook, timeout=TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
    client.execute()
    return notebook, time.perf_counter() - start


def main(paths):
    for path in paths:
        notebook, seconds = execute(path)
        nbformat.write(notebook, path)
        print(f"{path}: executed in {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
