"""`python -m par wheelhouse --out DIR`: the course's packages as wheels, for a GPU node without internet.

On a machine with internet it downloads (or builds) a wheel of every package the course needs except torch,
for a chosen Python and platform, into DIR, with the requirements file and the one install command for the node:

    python -m par wheelhouse --out wh --set batch --python 3.12 --platform manylinux_2_28_x86_64
    # carry wh/ and the repository to the node, then, in a venv that already has the node's torch:
    pip install --no-index --find-links wh -r wh/requirements.txt
    pip install --no-index --find-links wh --no-build-isolation --no-deps -e .

Two sets:

* `full`: everything `requirements.txt` names (JupyterLab, the grader, the tests, the browser driver);
* `batch`: what the batch (`python -m par batch`, papermill's kernel stack) and the GPU tier (`pytest -m gpu`)
  need, and nothing of JupyterLab.

torch is never in the wheelhouse: the node keeps its own build (par runs on torch 2.11 and later), and nothing
in either set depends on torch. setuptools is in both sets, since installing `par` itself from the checkout
builds it, and a node without internet cannot fetch a build backend.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from par.runtime.checks import check_writable, CheckError
from par.runtime.paths import ROOT

# The batch and the GPU tier: papermill and the kernel it drives, the figures, the widgets of lecture 01, pytest.
BATCH = ("papermill>=2.6", "ipykernel>=6.29", "nbformat>=5.9", "nbclient>=0.10", "ipywidgets>=8.1,<9",
         "matplotlib>=3.8", "tqdm>=4.66", "pytest>=8", "pytest-timeout>=2.3")
BUILD = ("setuptools>=61",)                       # par's build backend (pyproject.toml)
SETS = ("full", "batch")


def course_requirements(requirements: Path = ROOT / "requirements.txt") -> list[str]:
    """The requirement lines of `requirements.txt`, without torch and without the editable install of par."""
    lines = []
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-e") or re.match(r"torch\b", line):
            continue
        lines.append(line)
    return lines


def requirements_of(which: str) -> list[str]:
    """The requirement lines of one set, setuptools included."""
    if which not in SETS:
        raise CheckError(f"--set {which!r}: choose one of {', '.join(SETS)}")
    return [*(course_requirements() if which == "full" else BATCH), *BUILD]


def pip_command(dest: Path, requirements: Path, python: str | None, platform: str | None) -> list[str]:
    """pip's command: `pip wheel` for this interpreter (sdists are built into wheels here); `pip download` of
    binary wheels only for another Python or platform (pip cannot build for a machine it is not)."""
    if python is None and platform is None:
        return [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(dest), "-r", str(requirements)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest), "--only-binary=:all:",
           "-r", str(requirements)]
    if python:
        digits = python.replace(".", "")
        cmd += ["--python-version", python, "--implementation", "cp", "--abi", f"cp{digits}", "--abi", "abi3",
                "--abi", "none"]
    for tag in platform_tags(platform) if platform else ():
        cmd += ["--platform", tag]
    return cmd


LEGACY = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}   # PEP 600's names for older glibc floors


def platform_tags(platform: str) -> list[str]:
    """`platform` and every tag a node of that platform also installs: manylinux_2_28_x86_64 takes wheels built for
    glibc 2.28 and older (manylinux_2_27 ... manylinux_2_5, manylinux2014, ...). pip older than 24 does not widen
    a --platform it is given, so the list is spelt out."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    floor, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{g}_{arch}" for g in range(floor, 4, -1)]
    return tags + [f"{LEGACY[g]}_{arch}" for g in sorted(LEGACY, reverse=True) if g <= floor]


def install_lines(dest_name: str) -> list[str]:
    """The commands that install the wheelhouse on the node, offline, from the repository's root."""
    return [f"pip install --no-index --find-links {dest_name} -r {dest_name}/requirements.txt",
            f"pip install --no-index --find-links {dest_name} --no-build-isolation --no-deps -e ."]


def torch_in(dest: Path) -> list[str]:
    """Wheels of torch or of its CUDA libraries in `dest`: none may be there (the node's torch is kept)."""
    return sorted(p.name for p in dest.glob("*.whl") if re.match(r"(torch|triton|nvidia_)", p.name.lower()))


def normalised(name: str) -> str:
    """A distribution's name as PEP 503 compares it: `jupyter_client` -> `jupyter-client`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution(wheel: Path) -> str:
    """A wheel's distribution name, normalised: `Pillow-13.0-...whl` -> `pillow`."""
    return normalised(wheel.name.split("-")[0])


def build(dest: Path, which: str = "full", python: str | None = None, platform: str | None = None,
          node_has: tuple[str, ...] = ()) -> dict:
    """Fill `dest` with the wheels of set `which`, its requirements.txt and manifest.json; return the manifest.
    `node_has`: distributions the node already has (numpy in a torch image): their wheels are left out."""
    dest.mkdir(parents=True, exist_ok=True)
    reqs = requirements_of(which)
    with tempfile.TemporaryDirectory() as tmp:
        req_file = Path(tmp) / "requirements.txt"
        req_file.write_text("\n".join(reqs) + "\n")
        done = subprocess.run(pip_command(dest, req_file, python, platform), text=True, capture_output=True)
    if done.returncode != 0:
        last = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()][-1:] or ["no output"]
        raise CheckError(f"pip could not gather the {which} set: {last[0].strip()}")
    stray = torch_in(dest)
    if stray:
        raise CheckError(f"the wheelhouse holds torch's wheels ({', '.join(stray)}): a requirement pulled torch in")
    left_out = {normalised(name) for name in node_has}
    for wheel in dest.glob("*.whl"):
        if distribution(wheel) in left_out:
            wheel.unlink()
    (dest / "requirements.txt").write_text("\n".join(reqs) + "\n")
    wheels = sorted(dest.glob("*.whl"))
    manifest = {"set": which, "python": python or f"{sys.version_info.major}.{sys.version_info.minor}",
                "platform": platform or "this machine", "wheels": len(wheels), "node_has": sorted(left_out),
                "bytes": sum(p.stat().st_size for p in wheels), "install": install_lines(dest.name)}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m par wheelhouse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the folder the wheels go to")
    parser.add_argument("--set", dest="which", default="full", choices=SETS, help="full (default) or batch")
    parser.add_argument("--python", default=None, help="the node's Python, e.g. 3.12 (default: this one)")
    parser.add_argument("--platform", default=None, help="the node's platform tag, e.g. manylinux_2_28_x86_64")
    parser.add_argument("--node-has", default="", help="comma-separated packages the node already has, left out "
                        "(e.g. numpy, which a torch image usually carries)")
    args = parser.parse_args(argv)
    if args.python is not None and not re.fullmatch(r"3\.\d{1,2}", args.python):
        raise CheckError(f"--python {args.python!r}: give a CPython version such as 3.12")
    check_writable(args.out, directory=True, parents=True)      # before pip downloads anything
    manifest = build(args.out, args.which, args.python, args.platform,
                     tuple(n.strip() for n in args.node_has.split(",") if n.strip()))
    print(f"{args.out}: {manifest['wheels']} wheels, {manifest['bytes'] / 1e6:.1f} MB "
          f"({manifest['set']} set, Python {manifest['python']}, {manifest['platform']}"
          f"{'; the node has ' + ', '.join(manifest['node_has']) if manifest['node_has'] else ''}); on the node, in a venv "
          f"that has torch, from the repository's root:")
    for line in manifest["install"]:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
