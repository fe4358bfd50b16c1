"""The package as a user installs it: a wheel with its data, extras named in errors, one version.

The wheel test builds ``echoloss`` from a copy of the working tree, installs it into a fresh
virtual environment (which also sees the running Python's packages: torch and the extras come from
there rather than a multi-GB download) and runs what a new user runs first."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import echoloss
from echoloss._optional import EXTRAS, MissingExtraError, require, require_extra
from echoloss.train.presets import packaged_configs, resolve_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # the train extra installs tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_has_one_source():
    assert "version" not in PYPROJECT["project"]
    assert PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "echoloss.__version__"}
    assert isinstance(echoloss.__version__, str) and echoloss.__version__[0].isdigit()


def test_every_checked_extra_exists_in_pyproject():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)


def test_require_names_the_extra():
    with pytest.raises(MissingExtraError, match=r"pip install 'echoloss\[train\]'") as info:
        require("no_such_module_for_echoloss", extra="train", needed_by="the trainer")
    assert isinstance(info.value, ModuleNotFoundError)  # `except ImportError` keeps working
    assert "the trainer needs no_such_module_for_echoloss" in str(info.value)


def test_require_extra_lists_every_missing_module():
    with pytest.raises(MissingExtraError) as info:
        require_extra("x", needed_by="y", modules=["json", "no_such_a_mod", "no_such_b_mod"])
    msg = str(info.value)
    assert "not installed: no_such_a_mod, no_such_b_mod." in msg and "'echoloss[x]'" in msg
    assert "json" not in msg.split("not installed:")[1]


def test_trainer_without_the_train_extra_names_it():
    """``tokenizers`` hidden (``sys.modules[name] = None`` is how Python spells "not
    installed" for both ``import`` and ``find_spec``): a clean error, exit status 2."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["tokenizers"] = None
        from echoloss.train.cli import main
        sys.exit(main(["--max-steps", "1"]))
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert "echoloss-train needs the 'train' extra; not installed: tokenizers." in res.stderr
    assert "pip install 'echoloss[train]'" in res.stderr


def test_packaged_configs_are_the_repository_configs():
    names = packaged_configs()
    assert names == sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))
    for name in names:
        path = Path(resolve_config(name))
        assert path.read_text() == (ROOT / "configs" / f"{name}.toml").read_text()


def test_resolve_config_prefers_files_and_rejects_unknown_names(tmp_path, monkeypatch):
    assert resolve_config(None) is None
    assert resolve_config("configs/gpu.toml") == "configs/gpu.toml"  # a path is a path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpu").write_text("")
    assert resolve_config("gpu") == "gpu"  # an existing file wins over the packaged name
    with pytest.raises(
        FileNotFoundError, match="packaged: default, fast, gpu, gpu-pretrained, jsonl, pretrained"
    ):
        resolve_config("no-such-config")


def _copy_working_tree(dst: Path) -> None:
    """Tracked and untracked-but-not-ignored files, as they are now (links stay links)."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel, follow_symlinks=False)


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert res.returncode == 0, f"{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.mark.slow
def test_wheel_installs_and_runs_in_a_fresh_venv(tmp_path):
    src, dist, venv, work = (tmp_path / n for n in ("src", "dist", "venv", "work"))
    for d in (src, work):
        d.mkdir()
    _copy_working_tree(src)
    # the running Python's setuptools when it is recent enough (no download), else pip's isolation
    isolation = ["--no-build-isolation"] if _setuptools_at_least(69) else []
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(dist),
            str(src),
            *isolation,
        ]
    )
    [wheel] = dist.glob("echoloss-*.whl")
    assert wheel.name.startswith(f"echoloss-{echoloss.__version__}-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert "echoloss/py.typed" in names
        for cfg in ("default", "fast", "gpu", "gpu-pretrained", "jsonl", "pretrained"):
            data = z.read(f"echoloss/train/configs/{cfg}.toml").decode()
            assert data == (ROOT / "configs" / f"{cfg}.toml").read_text()  # content, not a link
        assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)
        # the experiments are research beside the package (examples/research/echo_experiment):
        # no module of the wheel runs one, computes its verdict or writes a docs page
        research = ("experiment", "persistence", "figures", "stats", "echo_experiment")
        leaked = [n for n in names if Path(n).stem in research or "echo_experiment" in n]
        assert not leaked, leaked
        entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "echoloss-train = echoloss.train.cli:main" in z.read(entry).decode()

    _run([sys.executable, "-m", "venv", str(venv)])
    py, bindir = venv / "bin" / "python", venv / "bin"
    _see_running_site_packages(py)
    # --no-deps: the dependencies are the running Python's (visible through the venv)
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)])
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    where = _run(
        [str(py), "-c", "import echoloss, sys; print(echoloss.__file__, echoloss.__version__)"],
        cwd=work,
        env=env,
    ).stdout.split()
    assert where[0].startswith(str(venv)), where  # the wheel, not the working tree
    assert where[1] == echoloss.__version__

    # the quickstart, as a user runs it from a directory of their own
    shutil.copy(ROOT / "examples" / "quickstart.py", work / "quickstart.py")
    code = "import quickstart; h = quickstart.main(steps=2, group_size=2, seed=0); print(len(h))"
    assert _run([str(py), "-c", code], cwd=work, env=env).stdout.strip().endswith("2")

    help_text = _run([str(bindir / "echoloss-train"), "--help"], cwd=work, env=env).stdout
    assert "--config" in help_text and "packaged config" in help_text
    assert "experiment" not in help_text.split("\n\n")[0]  # no such subcommand in the usage
    # a packaged config by name resolves and validates inside the installed package (training
    # on it is the trainer tests' job), and an unknown name lists the packaged ones
    code = (
        "from echoloss.train.config import load_config\n"
        "from echoloss.train.presets import resolve_config\n"
        "path = resolve_config('fast'); cfg = load_config(path); print(path)"
    )
    path = _run([str(py), "-c", code], cwd=work, env=env).stdout.strip()
    assert path.startswith(str(venv)) and path.endswith("echoloss/train/configs/fast.toml")
    res = subprocess.run(
        [str(bindir / "echoloss-train"), "--config", "no-such-config"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert (
        res.returncode == 2
        and "packaged: default, fast, gpu, gpu-pretrained, jsonl, pretrained" in res.stderr
    ), res.stderr


def _see_running_site_packages(py: Path) -> None:
    """Make the running Python's site-packages (torch, the extras) visible to the venv of ``py``,
    after its own: a ``.pth`` file listing them. ``--system-site-packages`` is not enough when
    the tests themselves run in a virtual environment (it exposes the base interpreter's
    packages, not this environment's). Paths listed in a ``.pth`` file are not scanned for
    further ``.pth`` files, so an editable install of echoloss there stays invisible."""
    import site

    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    dirs = [d for d in (*site.getsitepackages(), site.getusersitepackages()) if Path(d).is_dir()]
    (Path(purelib.stdout.strip()) / "_running_python.pth").write_text("\n".join(dirs) + "\n")


def _setuptools_at_least(major: int) -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return int(setuptools.__version__.split(".")[0]) >= major
