"""The progress display in a Jupyter kernel (the Python API's notebooks, issue 53): a live rich bar
where ipywidgets can draw it, plain lines (which a notebook shows as the cell's output) otherwise."""

from __future__ import annotations

import io
import sys
import types

import pytest

from rlhf.runtime.run import progress

pytestmark = pytest.mark.unit


class ZMQInteractiveShell:  # the class name IPython's kernel shell has
    pass


@pytest.fixture
def kernel(monkeypatch):
    fake = types.ModuleType("IPython")
    fake.get_ipython = lambda: ZMQInteractiveShell()
    monkeypatch.setitem(sys.modules, "IPython", fake)


def test_a_kernel_is_recognised_and_a_terminal_session_is_not(kernel, monkeypatch):
    assert progress.in_notebook()
    sys.modules["IPython"].get_ipython = lambda: None  # IPython imported, no kernel (a script)
    assert not progress.in_notebook()
    monkeypatch.delitem(sys.modules, "IPython")
    assert not progress.in_notebook()


@pytest.mark.filterwarnings("ignore:install \"ipywidgets\"")  # the fake kernel has no widgets to draw in
def test_in_a_kernel_with_widgets_the_bar_is_rich_and_rendered_for_jupyter(kernel, monkeypatch):
    monkeypatch.setattr(progress, "_widgets_installed", lambda: True)
    bar = progress.Progress(3, 0, stream=io.StringIO())
    try:
        assert bar._bar is not None and bar._bar.console.is_jupyter
    finally:
        bar.close()


def test_in_a_kernel_without_widgets_each_step_is_a_line(kernel, monkeypatch):
    monkeypatch.setattr(progress, "_widgets_installed", lambda: False)
    stream = io.StringIO()
    bar = progress.Progress(2, 0, stream=stream)
    bar.update(0, {"reward/mean": 0.5})
    bar.close()
    assert bar._bar is None and stream.getvalue().startswith("step 1/2  reward 0.500")
