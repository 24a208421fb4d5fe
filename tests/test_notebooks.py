"""The notebooks in notebooks/ run end to end (on the CPU in CI) and show what they claim to show.

They are executed with nbclient in a fresh Jupyter kernel. nbclient, nbformat and ipykernel are
in the ``test`` extra, so a missing one fails these tests instead of skipping them (CI would
otherwise pass without ever running a notebook); set ``PARALLEL_MODULES_ALLOW_MISSING_EXTRAS=1`` to
skip them on purpose.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from parallel_modules.timeline import KernelEvent, Timeline, load_timelines, save_timelines

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
ALLOW_MISSING_ENV = "PARALLEL_MODULES_ALLOW_MISSING_EXTRAS"
NAMES = ["getting_started.ipynb", "pipeline.ipynb", "timeline.ipynb"]


def _nb_modules() -> tuple[Any, Any]:
    try:
        import nbclient
        import nbformat
    except ImportError as e:
        if os.environ.get(ALLOW_MISSING_ENV):
            pytest.skip(f"notebook dependencies missing ({e}) and {ALLOW_MISSING_ENV} is set")
        pytest.fail(f"cannot run the notebooks: {e}. Install the test extra (pip install -e '.[test]'), "
                    f"or set {ALLOW_MISSING_ENV}=1 to skip these tests.", pytrace=False)
    return nbclient, nbformat


def run_notebook(path: Path, monkeypatch: pytest.MonkeyPatch, cwd: Path | None = None) -> str:
    r"""Executes the notebook in a new kernel started in ``cwd`` and returns all text it printed or displayed."""
    nbclient, nbformat = _nb_modules()
    # The kernel is a new process: make it import this checkout's package whatever its working
    # directory (a relative PYTHONPATH=. would point elsewhere), and never open a window.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("MPLBACKEND", raising=False)
    # Connection files and IPython's profile in a fresh folder: no dependence on a writable home
    # directory, nor on the user's IPython start-up scripts.
    scratch = Path(tempfile.mkdtemp(prefix="pm-jupyter-"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(scratch / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(scratch / "ipython"))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd or path.parent)}})
    try:
        client.execute()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                texts.append(out["text"])
            for kind in ("text/plain", "text/markdown"):
                if kind in out.get("data", {}):
                    texts.append(out["data"][kind])
    return "\n".join(texts)


@pytest.mark.parametrize("name", NAMES)
def test_notebooks_are_committed_without_outputs(name: str) -> None:
    _, nbformat = _nb_modules()
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name} has no code"
    assert all(c.outputs == [] and c.execution_count is None for c in code), f"{name}: clear its outputs"
    assert nb.metadata["kernelspec"]["name"] == "python3"


def newest_gpu_benchmark() -> dict:
    runs = [json.loads(p.read_text()) for p in sorted((ROOT / "benchmarks").glob("*.json"))]
    return max(runs, key=lambda r: ("gpu" in r["environment"], r["environment"]["date"]))


def test_getting_started(monkeypatch) -> None:
    text = run_notebook(NOTEBOOKS / "getting_started.ipynb", monkeypatch)
    assert "bit-for-bit equal to the sequential module: True" in text
    assert "same state-dict keys as nn.ModuleList: True" in text
    env = newest_gpu_benchmark()["environment"]
    assert f"Measured on {env['gpu']} on {env['date'][:10]}" in text
    assert "| inception | 1 | float32 | graph Parallel |" in text  # the table, read from the JSON


def test_getting_started_picks_up_a_newer_benchmark(tmp_path, monkeypatch) -> None:
    # A checkout with the committed run and a newer one (made up here, never committed).
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "notebooks").mkdir()
    for f in (ROOT / "benchmarks").glob("*.json"):  # runs only (PNGs, sub-folders of other tools skipped)
        shutil.copy(f, tmp_path / "benchmarks")
    newer = newest_gpu_benchmark()
    newer["environment"].update(date="2999-01-02T03:04:05", gpu="Test GPU 9000")
    (tmp_path / "benchmarks" / "a-sorts-first-by-name.json").write_text(json.dumps(newer))
    shutil.copy(NOTEBOOKS / "getting_started.ipynb", tmp_path / "notebooks")
    text = run_notebook(tmp_path / "notebooks" / "getting_started.ipynb", monkeypatch)
    assert "Benchmark file: benchmarks/a-sorts-first-by-name.json" in text
    assert "Measured on Test GPU 9000 on 2999-01-02" in text


def test_pipeline(monkeypatch) -> None:
    text = run_notebook(NOTEBOOKS / "pipeline.ipynb", monkeypatch)
    assert "chunks=4: shape (8, 10, 64, 64)" in text
    assert "a batch of 13 in 3 chunks: [5, 4, 4]" in text
    assert "RuntimeError: ParallelSequential: stage '0'" in text and "BatchNorm2d" in text
    bench = newest_gpu_benchmark()
    for case in ("encdec", "h2d"):
        if any(r["case"] == case for r in bench["results"]):
            assert f"{case}: batch" in text


def test_timeline_committed(monkeypatch) -> None:
    text = run_notebook(NOTEBOOKS / "timeline.ipynb", monkeypatch)
    trace = NOTEBOOKS / "data" / "inception_timeline.json"
    if trace.exists():  # says when and where it was recorded, from the file itself
        meta = next(iter(load_timelines(trace).values())).metadata
        assert f"recorded {meta['recorded']} on {meta['gpu']}" in text
    else:
        assert "No trace committed at notebooks/data/inception_timeline.json yet" in text
    assert "40.0% of busy time" in text  # the hand-made example
    if not torch.cuda.is_available():
        assert "stream timelines need a CUDA GPU" in text


def test_timeline_reads_a_trace_file(tmp_path, monkeypatch) -> None:
    # A stand-in for the GPU trace, made up for this test only (never committed).
    serial = Timeline([KernelEvent("conv", 7, 0, 10), KernelEvent("relu", 7, 10, 12)], "eager sequential")
    graphed = Timeline([KernelEvent("conv", 20, 0, 6), KernelEvent("conv", 21, 3, 9), KernelEvent("cat", 20, 9, 10)],
                       "Parallel(cuda_graph=True)")
    (tmp_path / "data").mkdir()
    save_timelines(tmp_path / "data" / "inception_timeline.json", serial, graphed,
                   metadata={"recorded": "2001-02-03T04:05:06", "gpu": "Synthetic Test GPU", "torch": "0.0",
                             "cuda": "0.0", "case": "test", "batch": 1, "dtype": "float32", "calls": 1})
    shutil.copy(NOTEBOOKS / "timeline.ipynb", tmp_path)
    text = run_notebook(tmp_path / "timeline.ipynb", monkeypatch)
    assert "recorded 2001-02-03T04:05:06 on Synthetic Test GPU" in text
    assert "eager sequential: 2 kernels on 1 stream(s)" in text
    assert ">= 2 streams at once: 0.0 us = 0.0% of busy time" in text
    # Graphed: busy [0, 10] = 10 us, two streams during [3, 6] = 3 us: 30 %.
    assert "Parallel(cuda_graph=True): 3 kernels on 2 stream(s)" in text
    assert ">= 2 streams at once: 3.0 us = 30.0% of busy time" in text
    assert "No trace committed" not in text
