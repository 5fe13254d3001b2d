"""Build the lent GPU machine's carry, .gpu-carry/ (ignored by git): the wheels of
requirements/gpu-carry.txt for that machine's Python 3.12, fetched with pip, sglang's own cut to
what its engine runs. A device command carries at most 64 MiB with the working tree; the carry must
stay under BUDGET_MB.

    python scripts/gpu/carry.py [--out .gpu-carry] [--check]

--check installs the carry here as scripts/gpu/run.sh installs it there (pip's --target, no index,
no dependencies) with a Python 3.12 (`python3.12`), and imports its compiled packages.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements" / "gpu-carry.txt"
IMAGE = Path(__file__).parent / "image-packages.txt"  # what the lent machine has already
BUDGET_MB = 56.0  # of 64 MiB: the working tree (about 5 MB) travels beside it
# the lent machine: CPython 3.12 on x86-64 Linux (glibc); pip matches manylinux tags one by one
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35, 39)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
# sglang's wheel: 39 MB, of it the Rust extensions (the radix tree falls back to Python without
# them) and trees the engine never imports
SGLANG_CUT = ("sglang/test/", "sglang/benchmark/", "sglang/bench_", "sglang/multimodal_gen/")
# what --check imports from the carry: the compiled packages (the rest is pure Python)
COMPILED = ["pydantic_core", "zmq", "orjson", "msgspec", "pybase64", "setproctitle", "jiter"]
COMPILED += ["zstandard", "greenlet", "sqlalchemy", "tvm_ffi", "pyqwest", "pyrage"]


def download(out: Path) -> list[Path]:
    """Every pinned wheel, for CPython 3.12 on the lent machine's platform, without dependencies
    (the list is whole)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3"]
    cmd += ["--abi", "none"] + [a for p in PLATFORMS for a in ("--platform", p)]
    cmd += ["--platform", "any", "-d", str(out), "-r", str(REQUIREMENTS)]
    subprocess.run(cmd, check=True)
    return sorted(out.glob("*.whl"))


def cut_sglang(wheel: Path) -> Path:
    """The sglang wheel without its Rust extensions and the trees the engine does not import: a
    valid wheel again (its RECORD lists what it holds)."""
    cut = wheel.with_name(wheel.name.replace(".whl", ".cut.whl"))
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(cut, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        kept = [
            info
            for info in src.infolist()
            if info.filename != record_name
            and not info.filename.endswith(".so")
            and not info.filename.startswith(SGLANG_CUT)
        ]
        # RECORD is CSV: some of sglang's file names hold commas (its MoE configs), quoted there
        record = io.StringIO()
        rows = csv.writer(record, lineterminator="\n")
        for info in kept:
            data = src.read(info)
            dst.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.writerow([info.filename, f"sha256={digest}", len(data)])
        rows.writerow([record_name, "", ""])
        dst.writestr(record_name, record.getvalue())
    # the cut wheel keeps the real name (pip reads name and version from it)
    wheel.unlink()
    return cut.rename(wheel)


def missing_requirements(wheels: list[Path]) -> list[str]:
    """What a carried wheel requires (on Python 3.12, Linux) that is neither carried nor in the
    image, and Orbit's own dependencies likewise: a missing one fails only when a device minute
    imports it. sglang's own list is not followed: the carry leaves its CUDA stack out on purpose
    (../shared/notes/gpu-sglang.md). An extra of a package in the image (httpx[http2]) is read from
    the package's metadata here."""
    env, image = _lent_python(), _image()
    carried, needs = set(), []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(z.read(name).decode())
        carried.add(canonicalize_name(meta["Name"]))
        if canonicalize_name(meta["Name"]) != "sglang":
            needs += [(meta["Name"], r) for r in meta.get_all("Requires-Dist") or []]
    needs += [("orbit-rl", r) for r in metadata.requires("orbit-rl") or []]
    have = carried | image
    missing = []
    for who, text in needs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        if canonicalize_name(req.name) not in have:
            missing.append(f"{req.name} (for {who})")
        for extra in req.extras:
            for sub in metadata.requires(req.name) or []:
                r = Requirement(sub)
                if r.marker is not None and r.marker.evaluate({**env, "extra": extra}):
                    if canonicalize_name(r.name) not in have:
                        missing.append(f"{r.name} (for {req.name}[{extra}], for {who})")
    return sorted(set(missing))


def orbit_requirements_uncovered() -> list[str]:
    """Orbit's own requirements that neither requirements/gpu-carry.txt pins nor the image has:
    the same check as `missing_requirements` for Orbit's part, without downloading the carry (a
    test runs it, so a new dependency is named here, not in a device minute)."""
    env = {**_lent_python(), "extra": ""}
    lines = [x.split("#")[0].strip() for x in REQUIREMENTS.read_text().splitlines()]
    have = {canonicalize_name(Requirement(x).name) for x in lines if x} | _image()
    missing = []
    for text in metadata.requires("orbit-rl") or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if canonicalize_name(req.name) not in have:
            missing.append(req.name)
    return sorted(missing)


def _lent_python() -> dict[str, str]:
    """The environment markers of the lent machine's Python (3.12 on x86-64 Linux)."""
    return {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3"}


def _image() -> set[str]:
    """The packages the lent machine has already (image-packages.txt), by canonical name."""
    return {canonicalize_name(x) for x in IMAGE.read_text().split() if not x.startswith("#")}


def python312() -> str:
    """A Python 3.12 here: on PATH, else one pyenv has installed but not enabled."""
    found = [
        shutil.which("python3.12"),
        *map(str, Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")),
    ]
    for python in filter(None, found):
        if subprocess.run([python, "-V"], capture_output=True).returncode == 0:
            return python
    raise SystemExit("--check needs a Python 3.12 (python3.12 on PATH, or pyenv's)")


def check(wheels: list[Path]) -> None:
    """Install as run.sh does, with a Python 3.12, and import the compiled packages."""
    python = python312()
    with tempfile.TemporaryDirectory() as target:
        cmd = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*cmd, "--target", target, *map(str, wheels)], check=True)
        code = "; ".join(f"import {m}" for m in COMPILED)
        subprocess.run([python, "-c", code], check=True, env={"PYTHONPATH": target})
    print(f"installed under {python} with --target, and imported {', '.join(COMPILED)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / ".gpu-carry")
    p.add_argument("--check", action="store_true", help="install it with python3.12, import it")
    args = p.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    wheels = download(args.out)
    for w in wheels:
        if w.name.startswith("sglang-"):
            cut_sglang(w)
    sizes = {w.name: w.stat().st_size / 2**20 for w in sorted(args.out.glob("*.whl"))}
    for name, mb in sorted(sizes.items(), key=lambda x: -x[1])[:8]:
        print(f"{mb:6.1f} MB  {name}")
    total = sum(sizes.values())
    print(f"{len(sizes)} wheels, {total:.1f} MB in {args.out} (budget {BUDGET_MB} MB)")
    if total > BUDGET_MB:
        raise SystemExit(f"the carry is {total:.1f} MB, over its {BUDGET_MB} MB")
    if args.check:
        missing = missing_requirements(sorted(args.out.glob("*.whl")))
        if missing:
            raise SystemExit("neither carried nor on the lent machine: " + ", ".join(missing))
        check(sorted(args.out.glob("*.whl")))


if __name__ == "__main__":
    main()
