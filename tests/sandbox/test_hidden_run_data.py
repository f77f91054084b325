"""Sandboxed code cannot read the run's data: a training run registers its data, eval data, run
directory, reward sources and project with `rlhf.sandbox.hide_by_default`; every call hides them
(files read as empty, directories as empty) and lists them in ``result.isolation``."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from rlhf import sandbox
from rlhf.sandbox import SandboxConfig, run_code

PRINT_FILE = "import sys\ntry:\n    print(repr(open(sys.argv[1] if len(sys.argv) > 1 else {path!r}).read()))\n" \
             "except OSError as exc:\n    print('refused', exc.errno)\n"


def _namespaces_here() -> bool:
    return "mount_ns" in run_code("pass", timeout_s=10).isolation


needs_namespaces = pytest.mark.skipif(not _namespaces_here(), reason="no mount namespace here: nothing can be hidden")


@pytest.fixture
def registered():
    yield sandbox.hide_by_default
    sandbox.hide_by_default(())


@pytest.fixture
def project():
    """A project outside /tmp (the sandbox's /tmp is its own already) and outside any home."""
    import os
    import shutil

    if not os.access("/var/lib", os.W_OK):
        pytest.skip("needs a writable folder outside /tmp and home directories (/var/lib as root)")
    tmp_path = Path("/var/lib") / f"rlhf-test-{uuid.uuid4().hex[:8]}"
    tmp_path.mkdir()
    answer = f"label-{uuid.uuid4().hex}"
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    data = root / "data" / "train.jsonl"
    data.write_text(json.dumps({"prompt": "What is the secret?", "answer": answer}) + "\n")
    elsewhere = tmp_path / "elsewhere.jsonl"  # a data file outside any hidden directory
    elsewhere.write_text(json.dumps({"answer": answer}) + "\n")
    for path in (data, elsewhere):
        path.chmod(0o644)  # world-readable, as data files are
    for folder in (tmp_path, root, root / "data"):
        folder.chmod(0o755)
    yield {"root": root, "data": data, "elsewhere": elsewhere, "answer": answer}
    shutil.rmtree(tmp_path)


@pytest.mark.unit
@needs_namespaces
def test_model_code_cannot_print_a_label_from_the_data_file(project, registered):
    code = PRINT_FILE.format(path=str(project["elsewhere"]))
    before = run_code(code, timeout_s=10)
    assert project["answer"] in before.stdout  # without hiding, the file is readable (root's sandbox uid too)
    hidden = registered([project["elsewhere"], project["root"]])
    assert hidden == tuple(sorted((str(project["elsewhere"]), str(project["root"]))))
    result = run_code(code, timeout_s=10)
    assert result.status == "ok", result
    assert project["answer"] not in result.stdout and result.stdout == "''\n"
    assert f"hidden:{project['elsewhere']}" in result.isolation
    assert f"hidden:{project['root']}" in result.isolation
    inside = run_code(PRINT_FILE.format(path=str(project["data"])), timeout_s=10)  # under a hidden directory
    assert project["answer"] not in inside.stdout
    listing = run_code(f"import os\nprint(os.listdir({str(project['root'])!r}))", timeout_s=10)
    assert listing.stdout == "[]\n"
    opted_out = run_code(code, config=SandboxConfig(timeout_s=10, hide_defaults=False))
    assert project["answer"] in opted_out.stdout and not any(x.startswith("hidden:") for x in opted_out.isolation)


@pytest.mark.unit
@needs_namespaces
def test_hide_paths_hides_a_single_file_too(project):
    result = run_code(PRINT_FILE.format(path=str(project["elsewhere"])),
                      config=SandboxConfig(timeout_s=10, hide_paths=(str(project["elsewhere"]),)))
    assert result.stdout == "''\n" and f"hidden:{project['elsewhere']}" in result.isolation


@pytest.mark.run
def test_a_training_run_registers_its_data_run_directory_rewards_and_project(tiny_model_dir, task, tmp_path, plugins,
                                                                           monkeypatch, registered):
    from tests.helpers import run_cli

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    seen = []
    real = sandbox.hide_by_default
    monkeypatch.setattr(sandbox, "hide_by_default", lambda paths: seen.append(real(paths)) or seen[-1])
    out = tmp_path / "run"
    result = run_cli(plugins, ["train", "--model", str(tiny_model_dir), "--data", str(task / "data.jsonl"),
                               "--eval-data", str(task / "data.jsonl"), "--label-key", "answer", "--reward",
                               f"{task / 'rewards.py'}:reward_func@0.5", "--n-samples", "2", "--prompts-per-step", "2",
                               "--max-new-tokens", "2", "--steps", "1", "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert seen and set(seen[-1]) == {str((task / "data.jsonl").resolve()), str((task / "rewards.py").resolve()),
                                      str(out.resolve()), str(project.resolve())}


@pytest.mark.unit
def test_system_directories_are_never_registered_as_the_project(tmp_path):
    from types import SimpleNamespace

    from rlhf.runtime.run.lifecycle import run_data_paths

    config = SimpleNamespace(data=[], eval_data=[], reward=["exact_match"], env="single_turn")
    assert run_data_paths(config, tmp_path / "run", cwd=Path("/")) == [str((tmp_path / "run").resolve())]
    assert run_data_paths(config, tmp_path / "run", cwd=Path("/tmp")) == [str((tmp_path / "run").resolve())]




@pytest.mark.unit
@needs_namespaces
def test_hidden_paths_under_tmp_are_hidden_by_the_private_tmp(tmp_path, registered):
    """Data under /tmp (a test's, a scratch run's): nothing to mount over, the code still runs, and the
    path is reported hidden (the sandbox's /tmp is its own)."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"answer": "42"}\n')
    registered([data, tmp_path])
    result = run_code("print(6 * 7)", timeout_s=10)
    assert result.status == "ok" and result.stdout == "42\n", result
    assert f"hidden:{data}" in result.isolation and f"hidden:{tmp_path}" in result.isolation
