"""Build, check and (only with --publish) publish the six rollouts packages, in dependency order.

    uv run python scripts/release.py                    # build every wheel and sdist into dist/, check them
    uv run python scripts/release.py --check-only       # check what dist/ holds, build nothing
    uv run python scripts/release.py --publish          # build, check, then `uv publish` (UV_PUBLISH_TOKEN)

The order is the packages' own: rollouts-types first, then what depends only on it (losses, data,
sync), then backends, then loops, so a package is on the index before any package that needs it.
The checks read each wheel's METADATA and each sdist's PKG-INFO against the package's
pyproject.toml (name, version, Python requirement, dependencies and extras, the README as a
Markdown description) and then run `twine check --strict` through uvx (`--no-twine` skips it).
Standard library only, so it runs with any Python 3.11+.
"""

from __future__ import annotations

import argparse
import email.parser
import email.policy
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_COMMAND_TIMEOUT_S = 600
_NAME_NORMALIZE = re.compile(r"[-_.]+")


@dataclass(frozen=True, slots=True, kw_only=True)
class Package:
    """One workspace package as its pyproject.toml declares it."""

    name: str
    version: str
    requires_python: str
    dependencies: tuple[str, ...]
    extras: tuple[str, ...]
    readme: str


def _normalize(name: str) -> str:
    return _NAME_NORMALIZE.sub("-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0])


def workspace_packages(root: Path = ROOT) -> list[Package]:
    """Every package under packages/, in dependency order (each after the packages it depends on)."""
    packages = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        packages[project["name"]] = Package(
            name=project["name"],
            version=project["version"],
            requires_python=project.get("requires-python", ""),
            dependencies=tuple(project.get("dependencies", ())),
            extras=tuple(project.get("optional-dependencies", {})),
            readme=(pyproject.parent / project["readme"]).read_text(encoding="utf-8"),
        )
    ordered: list[Package] = []
    while len(ordered) < len(packages):
        placed = {p.name for p in ordered}
        ready = [
            p
            for p in packages.values()
            if p.name not in placed and {_requirement_name(d) for d in p.dependencies} & set(packages) <= placed
        ]
        if not ready:
            raise ValueError(f"the packages {sorted(set(packages) - placed)} depend on each other in a cycle")
        ordered += sorted(ready, key=lambda p: p.name)
    return ordered


def _run(*args: str) -> None:
    print("+", " ".join(args), flush=True)
    subprocess.run(args, cwd=ROOT, check=True, timeout=_COMMAND_TIMEOUT_S)


def build(packages: list[Package], out: Path) -> None:
    """Each package's sdist and wheel into `out`, as a user's index would serve them (no workspace sources).

    Earlier builds of these packages in `out` are removed first, so the folder holds one version of each.
    """
    out.mkdir(parents=True, exist_ok=True)
    for package in packages:
        stem = package.name.replace("-", "_")
        for old in [*out.glob(f"{stem}-*.whl"), *out.glob(f"{stem}-*.tar.gz")]:
            old.unlink()
        _run("uv", "build", "--package", package.name, "--no-sources", "--out-dir", str(out))


def _wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as wheel:
        (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        return wheel.read(name).decode("utf-8")


def _sdist_metadata(path: Path) -> str:
    with tarfile.open(path) as sdist:
        (member,) = [m for m in sdist.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")]
        extracted = sdist.extractfile(member)
        assert extracted is not None, f"{member.name} in {path.name} is not a file"
        return extracted.read().decode("utf-8")


def check_metadata(package: Package, artifact: Path, text: str) -> list[str]:
    """What is wrong with one artifact's metadata against its pyproject.toml (empty: nothing)."""
    message = email.parser.Parser(policy=email.policy.compat32).parsestr(text)
    where = artifact.name
    problems = []
    expected = {"Name": package.name, "Version": package.version, "Requires-Python": package.requires_python}
    for field, value in expected.items():
        if message.get(field) != value:
            problems.append(f"{where}: {field} is {message.get(field)!r}, pyproject.toml says {value!r}")
    declared = {_requirement_name(d) for d in package.dependencies}
    required = {_requirement_name(r) for r in message.get_all("Requires-Dist", []) if "extra ==" not in r}
    if required != declared:
        problems.append(f"{where}: Requires-Dist names {sorted(required)}, pyproject.toml {sorted(declared)}")
    if set(message.get_all("Provides-Extra", [])) != set(package.extras):
        problems.append(
            f"{where}: extras {message.get_all('Provides-Extra', [])}, pyproject.toml {list(package.extras)}"
        )
    if message.get("Description-Content-Type") != "text/markdown":
        problems.append(f"{where}: Description-Content-Type is {message.get('Description-Content-Type')!r}")
    if message.get_payload().strip() != package.readme.strip():
        problems.append(f"{where}: the long description is not the package's README.md")
    return problems


def check(packages: list[Package], out: Path, *, twine: bool) -> list[str]:
    """Check one wheel and one sdist per package in `out`; returns the problems found (empty: all good)."""
    problems: list[str] = []
    files: list[Path] = []
    for package in packages:
        stem = package.name.replace("-", "_")
        for pattern, read in ((f"{stem}-*.whl", _wheel_metadata), (f"{stem}-*.tar.gz", _sdist_metadata)):
            found = sorted(out.glob(pattern))
            if len(found) != 1:
                problems.append(f"{out}: expected one {pattern}, found {[p.name for p in found]}")
                continue
            files += found
            problems += check_metadata(package, found[0], read(found[0]))
    if twine and files:
        if shutil.which("uvx") is None:
            problems.append("twine check: uvx is not on PATH (install uv, or pass --no-twine)")
        else:
            result = subprocess.run(
                ["uvx", "twine", "check", "--strict", *map(str, files)],
                capture_output=True,
                text=True,
                timeout=_COMMAND_TIMEOUT_S,
            )
            print(result.stdout, end="")
            if result.returncode != 0:
                problems.append(f"twine check --strict failed:\n{result.stdout}{result.stderr}")
    return problems


def publish(packages: list[Package], out: Path) -> None:
    """`uv publish` each package's files, in dependency order (credentials from uv's usual settings)."""
    for package in packages:
        stem = package.name.replace("-", "_")
        _run("uv", "publish", *map(str, sorted([*out.glob(f"{stem}-*.whl"), *out.glob(f"{stem}-*.tar.gz")])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="the folder of wheels and sdists (dist/)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check-only", action="store_true", help="check what --out holds; build nothing")
    mode.add_argument("--publish", action="store_true", help="after building and checking, upload in order")
    parser.add_argument("--no-twine", action="store_true", help="skip `uvx twine check` (offline)")
    args = parser.parse_args(argv)

    packages = workspace_packages()
    print("order:", ", ".join(f"{p.name} {p.version}" for p in packages))
    if not args.check_only:
        build(packages, args.out)
    problems = check(packages, args.out, twine=not args.no_twine)
    for problem in problems:
        print("problem:", problem, file=sys.stderr)
    if problems:
        return 1
    print(f"checked {2 * len(packages)} files in {args.out}: metadata matches every pyproject.toml")
    if args.publish:
        publish(packages, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
