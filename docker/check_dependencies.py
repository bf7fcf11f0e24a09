#!/usr/bin/env python3
"""Build-time dependency check for the deepinfer-server image.

Runs `pip check` (or reads its recorded output) and fails on every dependency conflict except
the ones explicitly allowed. The only allowance by default is DeepInfer's intentional NCCL
override: torch pins nvidia-nccl-cu13 2.29.7, DeepInfer's DeepEP needs 2.32.3. The allowance is
exact: another NCCL version, another requiring package, or any other conflict still fails.

Usage: check_dependencies.py [--pip-check-output FILE] [--allow PKG:DEP:REQUIRED:INSTALLED ...]
Exit code 0 when every conflict is allowed, 1 otherwise (each conflict is printed).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass

NO_CONFLICTS = "No broken requirements found."

# "torch 2.13.0+cu132 has requirement nvidia-nccl-cu13==2.29.7; platform_system == "Linux",
#  but you have nvidia-nccl-cu13 2.32.3."
_MISMATCH = re.compile(
    r"^(?P<package>\S+) (?P<version>\S+) has requirement (?P<requirement>.+), "
    r"but you have (?P<dependency>\S+) (?P<installed>\S+)\.$"
)
# "foo 1.0 requires bar, which is not installed."
_MISSING = re.compile(
    r"^(?P<package>\S+) (?P<version>\S+) requires (?P<dependency>.+), which is not installed\.$"
)


@dataclass(frozen=True)
class Allowance:
    """One tolerated conflict: `package` pins `dependency` to `required`, `installed` is present."""

    package: str
    dependency: str
    required: str
    installed: str

    @classmethod
    def parse(cls, text: str) -> Allowance:
        parts = text.split(":")
        if len(parts) != 4 or not all(parts):
            raise argparse.ArgumentTypeError(f"expected PKG:DEP:REQUIRED:INSTALLED, got {text!r}")
        return cls(_normalise(parts[0]), _normalise(parts[1]), parts[2], parts[3])


DEFAULT_ALLOWANCES = (Allowance("torch", "nvidia-nccl-cu13", "2.29.7", "2.32.3"),)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pinned_version(requirement: str, dependency: str) -> str | None:
    """The version of `dependency==X` in a requirement string, ignoring environment markers."""
    specifier = requirement.split(";", 1)[0].strip()
    match = re.fullmatch(r"(?P<name>[A-Za-z0-9_.\-]+)\s*==\s*(?P<version>[^\s,;]+)", specifier)
    if match is None or _normalise(match["name"]) != dependency:
        return None
    return match["version"]


def _is_allowed(line: str, allowances: tuple[Allowance, ...]) -> bool:
    match = _MISMATCH.match(line)
    if match is None:
        return False
    package = _normalise(match["package"])
    dependency = _normalise(match["dependency"])
    required = _pinned_version(match["requirement"], dependency)
    return any(
        allowance.package == package
        and allowance.dependency == dependency
        and allowance.required == required
        and allowance.installed == match["installed"]
        for allowance in allowances
    )


def evaluate(
    pip_check_output: str, allowances: tuple[Allowance, ...]
) -> tuple[list[str], list[str]]:
    """Split pip check's lines into (allowed, failing); unrecognised lines fail."""
    allowed: list[str] = []
    failing: list[str] = []
    for raw in pip_check_output.splitlines():
        line = raw.strip()
        if not line or line == NO_CONFLICTS:
            continue
        (allowed if _is_allowed(line, allowances) else failing).append(line)
    return allowed, failing


def _run_pip_check() -> str:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, check=False
    )
    return result.stdout + result.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fail the build on dependency conflicts.")
    parser.add_argument("--pip-check-output", help="read recorded `pip check` output from a file")
    parser.add_argument(
        "--allow",
        action="append",
        type=Allowance.parse,
        help="a tolerated conflict PKG:DEP:REQUIRED:INSTALLED (default: the NCCL override)",
    )
    args = parser.parse_args(argv)
    allowances = tuple(args.allow) if args.allow else DEFAULT_ALLOWANCES
    if args.pip_check_output:
        with open(args.pip_check_output, encoding="utf-8") as stream:
            output = stream.read()
    else:
        output = _run_pip_check()
    allowed, failing = evaluate(output, allowances)
    for line in allowed:
        print(f"allowed (intentional override): {line}")
    for line in failing:
        print(f"CONFLICT: {line}")
    if failing:
        print(f"dependency check failed: {len(failing)} conflict(s)", file=sys.stderr)
        return 1
    print("dependency check passed" + (f" ({len(allowed)} allowed override)" if allowed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
