"""The built wheel works outside the source tree.

One module-scoped fixture builds the wheel from the repo root (no network, no build
isolation), creates a fresh venv from the base interpreter, installs the wheel there with
`--no-deps --no-index`, and exposes the dev venv's site-packages through a `.pth` path line
so the third-party dependencies import. A path line does not process the `.pth` files of
that directory, so the dev venv's editable `meshrl` finder stays inactive: every `meshrl`
import in the fresh venv must come from the installed wheel. All subprocesses run with a
temporary cwd, so the repo is never on `sys.path`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
# Source folder -> installed package, as [tool.setuptools.package-dir] maps them.
PACKAGE_DIRS = {
    src: package.replace(".", "/")
    for package, src in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].items()
}
# Build by-products setuptools leaves in the source tree; removed afterwards if we made them.
BUILD_LEFTOVERS = ("build", "meshrl.egg-info")


@dataclass
class Installed:
    wheel: Path
    venv: Path
    python: Path
    meshrl: Path
    site_packages: Path
    workdir: Path  # a cwd outside the repo


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV", "CONDA"))}
    env.update(
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def _run(cmd: list[str | Path], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout
    )


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    assert proc.returncode == 0, f"{what} failed (rc={proc.returncode})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def _base_python() -> str:
    candidates = [getattr(sys, "_base_executable", None)]
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates += [os.path.join(sys.base_prefix, "bin", name), os.path.join(sys.base_prefix, "bin", "python3")]
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    pytest.skip("no base interpreter found to create a fresh venv from")


def _is_within(path: str | Path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    pytest.importorskip("setuptools", reason="building without isolation needs setuptools in this venv")
    pytest.importorskip("pip")
    tmp = tmp_path_factory.mktemp("packaging")
    workdir = tmp / "cwd"
    workdir.mkdir()

    # 1. build the wheel from the repo root with the running interpreter.
    pre_existing = {name for name in BUILD_LEFTOVERS if (REPO_ROOT / name).exists()}
    wheel_dir = tmp / "wheelhouse"
    try:
        proc = _run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheel_dir, REPO_ROOT],
            cwd=workdir,
            timeout=180,
        )
    finally:
        for name in set(BUILD_LEFTOVERS) - pre_existing:
            shutil.rmtree(REPO_ROOT / name, ignore_errors=True)
    _check(proc, "pip wheel")
    wheels = sorted(wheel_dir.glob("meshrl-*.whl"))
    assert len(wheels) == 1, f"expected exactly one meshrl wheel, got {wheels}"

    # 3. a fresh venv from the base interpreter, the wheel installed offline.
    venv = tmp / "venv"
    _check(_run([_base_python(), "-m", "venv", venv], cwd=workdir), "python -m venv")
    python = venv / "bin" / "python"
    _check(
        _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-cache-dir", wheels[0]], cwd=workdir),
        "pip install wheel",
    )
    site_packages = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=workdir).stdout.strip()
    )
    assert site_packages.is_dir() and _is_within(site_packages, venv), site_packages
    dev_site = sysconfig.get_paths()["purelib"]
    assert not _is_within(dev_site, venv)
    (site_packages / "zz_meshrl_dev_deps.pth").write_text(dev_site + "\n")

    return Installed(
        wheel=wheels[0],
        venv=venv,
        python=python,
        meshrl=venv / "bin" / "meshrl",
        site_packages=site_packages,
        workdir=workdir,
    )


# 2. the wheel's contents --------------------------------------------------------------------


def test_wheel_contains_package_modules_data_and_entry_point(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        names = set(zf.namelist())
        dist_info = {n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")}
        assert len(dist_info) == 1, dist_info
        (dist_info_dir,) = dist_info
        entry_points = zf.read(f"{dist_info_dir}/entry_points.txt").decode()

    for required in ("meshrl/loss_adapters/prime_rl.py", "meshrl/configs/local.toml", "meshrl/cli/main.py"):
        assert required in names, f"{required} missing from {installed.wheel.name}"

    # Every module and preset in the mapped source folders ships (catches subpackages or data
    # files the explicit `packages` / `package-data` lists would silently drop).
    missing = []
    for src, dest in PACKAGE_DIRS.items():
        for path in (REPO_ROOT / src).rglob("*"):
            if "__pycache__" in path.parts or path.suffix not in (".py", ".toml"):
                continue
            arcname = f"{dest}/{path.relative_to(REPO_ROOT / src).as_posix()}"
            if arcname not in names:
                missing.append(arcname)
    assert not missing, f"source files missing from the wheel: {missing}"

    section = None
    scripts = {}
    for line in entry_points.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and section == "console_scripts":
            key, value = (part.strip() for part in line.split("=", 1))
            scripts[key] = value
    assert scripts.get("meshrl") == "meshrl.cli.main:main", entry_points


def test_wheel_has_nothing_outside_the_meshrl_namespace(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as zf:
        names = zf.namelist()
    tops = {n.split("/", 1)[0] for n in names}
    stray = {t for t in tops if t != "meshrl" and not t.endswith(".dist-info")}
    assert not stray, f"top-level entries outside meshrl/: {sorted(stray)}"
    for generic in (*PACKAGE_DIRS, "tests", "benchmarks"):
        assert not any(n.startswith(f"{generic}/") for n in names), f"top-level {generic}/ in the wheel"
    assert not any(n.startswith(("meshrl/tests/", "meshrl/benchmarks/")) for n in names)
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


# 3. imports in the fresh venv come from the wheel, not the repo ------------------------------

IMPORT_PROBE = r"""
import importlib.resources, json, sys
import meshrl.loss_adapters, meshrl.configs, meshrl.cli.main, meshrl.loss_adapters.prime_rl
local = importlib.resources.files("meshrl.configs").joinpath("local.toml")
print(meshrl.loss_adapters.__file__)
print(json.dumps({
    "loss_adapters": meshrl.loss_adapters.__file__,
    "configs": meshrl.configs.__file__,
    "cli": meshrl.cli.main.__file__,
    "prime_rl": meshrl.loss_adapters.prime_rl.__file__,
    "namespace_path": list(meshrl.__path__),
    "local_toml": str(local),
    "local_toml_is_file": local.is_file(),
    "editable_finder_loaded": any(m.startswith("__editable__") for m in sys.modules),
    "editable_finder_on_meta_path": any("editable" in repr(f).lower() for f in sys.meta_path),
    "sys_path": sys.path,
}))
"""


def test_fresh_venv_imports_meshrl_from_the_wheel(installed: Installed) -> None:
    proc = _run([installed.python, "-c", IMPORT_PROBE], cwd=installed.workdir)
    _check(proc, "import probe")
    first_line, payload = proc.stdout.strip().splitlines()[0], proc.stdout.strip().splitlines()[-1]
    info = json.loads(payload)

    assert _is_within(first_line, installed.venv), (
        f"meshrl.loss_adapters imported from {first_line}, not the fresh venv"
    )
    assert not _is_within(first_line, REPO_ROOT), f"meshrl.loss_adapters imported from the source tree: {first_line}"
    for key in ("loss_adapters", "configs", "cli", "prime_rl", "local_toml"):
        assert _is_within(info[key], installed.site_packages), f"{key}: {info[key]} is not from the installed wheel"
        assert not _is_within(info[key], REPO_ROOT), f"{key}: {info[key]} comes from the source tree"
    assert info["namespace_path"] and all(_is_within(p, installed.site_packages) for p in info["namespace_path"]), info[
        "namespace_path"
    ]
    assert info["local_toml_is_file"], "package data meshrl/configs/local.toml not installed"
    assert not info["editable_finder_loaded"], "the dev venv's editable finder was activated"
    assert not info["editable_finder_on_meta_path"], "an editable finder is on sys.meta_path"
    repo = str(REPO_ROOT.resolve())
    assert not any(p and str(Path(p).resolve()) == repo for p in info["sys_path"]), "repo root on sys.path"


# 4. the console script works from outside the repo ------------------------------------------


def test_console_script_help(installed: Installed) -> None:
    assert installed.meshrl.is_file(), "console script bin/meshrl not installed"
    proc = _run([installed.meshrl, "--help"], cwd=installed.workdir)
    _check(proc, "meshrl --help")
    assert "usage" in proc.stdout.lower()


def test_console_script_config_show(installed: Installed) -> None:
    proc = _run([installed.meshrl, "config", "show", "--loss.type", "ipo"], cwd=installed.workdir)
    _check(proc, "meshrl config show --loss.type ipo")
    assert 'type = "ipo"' in proc.stdout, proc.stdout


def test_console_script_reads_installed_preset(installed: Installed) -> None:
    """The shipped preset (package data) is usable from the installed location."""
    preset = installed.site_packages / "meshrl" / "configs" / "local.toml"
    assert preset.is_file()
    proc = _run([installed.meshrl, "config", "show", "@", preset, "--loss.type", "ipo"], cwd=installed.workdir)
    _check(proc, "meshrl config show @ <installed local.toml>")
    assert 'type = "ipo"' in proc.stdout, proc.stdout
